#!/usr/bin/env bash
# One prepared GPU run (issue 53): install the carried wheels, run every GPU test and the GPU
# bench, and write a JSON summary and the logs under $OUT (what comes back from a lent GPU
# machine). On a machine without CUDA it runs too and reports every CUDA test skipped, with
# the reason. docs/TESTING.md ("On a lent GPU") gives the exact device `run` call.
#
#   bash scripts/gpu_run.sh [--install]     # --install: the wheels in .whl/ (scripts/gpu_wheels.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ "${1:-}" = "--install" ]; then
  # Into a folder of their own, ahead of the image's packages: its torch (CUDA) stays in use.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tee "$OUT/install.log" || { echo "installing the wheels failed: $OUT/install.log"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
"$PY" scripts/gpu_run.py --out "$OUT" 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
