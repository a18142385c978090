"""The files of `weightsync` one push passes through, on the trainer and in the engine.

Builds the tiny model, starts `weightsync serve` on it, pushes twice from a trainer
process as the README does (`ws.WeightSync([ws.SGLangEngine(url)], transport=...)`), and
records every `weightsync` source file a Python function of either process entered during
the second push (the first one also asks the engine what it can do). Both processes run
the sources under `--src`, so the same command reads an older checkout:

    python scripts/push_path.py                          # this checkout, http
    git worktree add /tmp/before bc88a25
    python scripts/push_path.py --src /tmp/before/src    # the same push in that checkout

Prints the package's top-level module count, then each side's files. Needs the checkout's
.venv (torch, transformers); stdlib only here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TRACER = '''\
import os, signal, sys, threading
_seen, _marker = set(), os.sep + "weightsync" + os.sep

def _profile(frame, event, arg):
    if event == "call" and _marker in frame.f_code.co_filename:
        _seen.add(frame.f_code.co_filename)

def _reset(*_):
    _seen.clear()

def _dump(*_):
    with open(os.environ["PUSH_PATH_OUT"], "w") as out:
        out.write("\\n".join(sorted(_seen)))

if os.environ.get("PUSH_PATH_OUT"):
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    signal.signal(signal.SIGUSR1, _reset)
    signal.signal(signal.SIGUSR2, _dump)
'''

TRAINER = '''\
import json, os, signal, sys, threading
import torch
import weightsync as ws
from transformers import AutoModelForCausalLM

seen, marker = set(), os.sep + "weightsync" + os.sep
def profile(frame, event, arg):
    if event == "call" and marker in frame.f_code.co_filename:
        seen.add(frame.f_code.co_filename)

model_dir, url, transport, server_pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.setprofile(profile); threading.setprofile(profile)  # before any thread of the sync starts
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
sync = ws.WeightSync(engines=[ws.SGLangEngine(url)], transport=transport, mode="full")
assert sync.push(model, version=1).verified
with torch.no_grad():
    next(model.parameters()).add_(1e-3)
os.kill(server_pid, signal.SIGUSR1)
seen.clear()
report = sync.push(model, version=2)
sys.setprofile(None); threading.setprofile(None)
os.kill(server_pid, signal.SIGUSR2)
assert report.verified, report
sync.close()
print(json.dumps(sorted(seen)))
'''


def _relative(paths: list[str], src: Path) -> list[str]:
    package = (src / "weightsync").resolve()
    return sorted(str(Path(p).resolve().relative_to(package)) for p in paths
                  if Path(p).resolve().is_relative_to(package))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=ROOT / "src", help="the sources to run (default: this checkout's)")
    parser.add_argument("--transport", default="http", help="disk, http, broadcast or shm (default http)")
    args = parser.parse_args()
    src = args.src.resolve()
    package = src / "weightsync"
    top = sorted(p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__"))
    print(f"{src}: {len(top)} top-level modules in weightsync/ (beside __init__ and __main__), "
          f"{sum(1 for _ in package.rglob('*.py'))} files in all")

    with tempfile.TemporaryDirectory(prefix="push-path-") as tmp:
        work = Path(tmp)
        (work / "tracer").mkdir()
        (work / "tracer" / "sitecustomize.py").write_text(TRACER)
        env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
        model_dir = work / "model"
        subprocess.run([sys.executable, "-c", "import sys; from weightsync.tiny import TinyModelConfig, "
                        "make_tiny_model; make_tiny_model(sys.argv[1], TinyModelConfig())", str(model_dir)],
                       env=env, check=True, capture_output=True)
        engine_out = work / "engine.txt"
        server = subprocess.Popen(
            [sys.executable, "-m", "weightsync", "serve", "--model", str(model_dir), "--disk-root", tmp],
            env={**env, "PYTHONPATH": f"{work / 'tracer'}{os.pathsep}{src}", "PUSH_PATH_OUT": str(engine_out)},
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert server.stdout is not None
            first = server.stdout.readline()
            if "listening on" not in first:
                raise SystemExit(f"weightsync serve did not start: {first!r}")
            url = first.split("listening on ")[1].strip()
            done = subprocess.run([sys.executable, "-c", TRAINER, str(model_dir), url, args.transport,
                                   str(server.pid)], env=env, capture_output=True, text=True, cwd=tmp)
            if done.returncode != 0:
                raise SystemExit(f"the trainer failed:\n{done.stderr[-3000:]}")
            trainer = _relative(json.loads(done.stdout.strip().splitlines()[-1]), src)
            for _ in range(100):  # the engine writes its files when its main thread takes SIGUSR2
                if engine_out.exists():
                    break
                time.sleep(0.1)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
        engine = _relative(engine_out.read_text().split("\n"), src)

    for side, files in (("trainer", trainer), ("engine (weightsync serve)", engine)):
        print(f"\none {args.transport} push, {side}: {len(files)} files")
        print(textwrap.indent("\n".join(files), "  "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
