#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels a lent GPU machine lacks for
# scripts/gpu_run.sh: that machine is bare and offline, with its own python3 3.12 and
# torch 2.11+cu130 (no CUDA torch travels: its wheel is over the 64 MiB a call carries).
# The versions are this project's (scripts/constraints.txt); each is pure Python or
# manylinux x86_64 for CPython 3.12. Run it here once; the next session just runs
# the `run` call docs/TESTING.md ("On a lent GPU") gives.
#
#   bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# What the GPU image lacks or holds at another version (the device tool's KINDS.md lists
# its packages): the server's web stack, transformers 5.19 (the image has 5.17) with
# the regex it needs, peft matching it, typing-extensions new enough for pydantic.
WHEELS=(
  transformers==5.19.0
  peft==0.21.2
  regex==2026.11.19
  fastapi==0.136.3
  starlette==1.10.0
  uvicorn==0.54.0
  pydantic==2.14.3
  pydantic-core==2.50.4
  annotated-types==0.8.0
  annotated-doc==0.0.7
  typing-inspection==0.4.5
  typing-extensions==4.16.0
)
mkdir -p .whl
rm -f .whl/*.whl
"$PYTHON" -m pip --disable-pip-version-check download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
ls -la .whl
du -sh .whl
