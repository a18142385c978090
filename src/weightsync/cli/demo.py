"""`weightsync demo`: the main job. A GRPO-style RL loop on a tiny model that
pushes its weights into a live engine every step, verified."""

from __future__ import annotations

import argparse
from pathlib import Path

from weightsync.cli.tools import tools_installed
from weightsync.manifest import MODES
from weightsync.transports import TRANSPORTS

EPILOG = """examples:
  weightsync demo                                  # LoRA tensors over HTTP to the embedded engine
  weightsync demo --mode full --transport broadcast
  weightsync demo --mode lora-merged --transport shm --steps 20
  weightsync demo --engine vllm --mode full --transport broadcast
  weightsync demo --mode full --engine-dtype bfloat16   # fp32 trainer, bf16 engine, cast in the stream
  weightsync demo --json > report.json
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run an RL loop that syncs weights into an engine every step",
                       description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="lora")
    p.add_argument("--transport", choices=TRANSPORTS, default=None,
                   help="default: http for the embedded engine, shm for vLLM (it takes no http)")
    p.add_argument("--engine", choices=["embedded", "vllm"], default="embedded")
    p.add_argument("--engine-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the dtype the engine serves; the trainer keeps float32 weights (default float32)")
    p.add_argument("--steps", type=int, default=30, help="RL steps, one push each (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output directory (default runs/demo)")
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout")


def run(args: argparse.Namespace) -> int:
    if not tools_installed("demo"):
        return 1
    from weightsync_tools.demo.command import run as run_demo

    return run_demo(args)
