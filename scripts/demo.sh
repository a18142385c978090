#!/usr/bin/env bash
# The main job: installs weightsync, then runs `weightsync demo` (an RL loop
# that syncs weights into the embedded engine every step). Extra arguments go
# to the demo, e.g. `bash scripts/demo.sh --mode full --transport broadcast`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh tools
exec .venv/bin/weightsync demo "$@"
