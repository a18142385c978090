#!/usr/bin/env bash
# Repeat tests to catch the ones that pass or fail by chance (not in CI): each given
# pytest node id N times in one session, then counts and one JSON line (scripts/stress.py).
# Installs what it needs into ./.venv as scripts/test.sh does, unless PYTHON names
# the interpreter to use.
#
#   bash scripts/stress.sh [--count N] [NODE_ID ...] [-- PYTEST ARGS]   # default: pause-mode tests x 20
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    bash scripts/setup.sh dev,vllm,tools,integrations >&2
    PYTHON=.venv/bin/python
fi
export WEIGHTSYNC_REQUIRE_VLLM=1   # vLLM tests fail, never skip, when vllm is missing
exec "$PYTHON" scripts/stress.py "$@"
