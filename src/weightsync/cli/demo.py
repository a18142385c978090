"""`weightsync demo`: the main job. A GRPO-style RL loop on a tiny model that
pushes its weights into a live engine every step, verified."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
    p.add_argument("--mode", choices=["lora", "full", "lora-merged"], default="lora")
    p.add_argument("--transport", choices=["http", "shm", "broadcast", "disk"], default=None,
                   help="default: http for the embedded engine, shm for vLLM (it takes no http)")
    p.add_argument("--engine", choices=["embedded", "vllm"], default="embedded")
    p.add_argument("--engine-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the dtype the engine serves; the trainer keeps float32 weights (default float32)")
    p.add_argument("--steps", type=int, default=30, help="RL steps, one push each (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output directory (default runs/demo)")
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from weightsync.demo import DemoConfig, StepRow, run_demo
    from weightsync.demo.report import format_table, write_json, write_plot

    transport = args.transport or ("shm" if args.engine == "vllm" else "http")
    cfg = DemoConfig(steps=args.steps, mode=args.mode, transport=transport, engine=args.engine,
                     engine_dtype=args.engine_dtype, seed=args.seed, out_dir=args.out)
    print(f"weightsync demo: {cfg.mode} over {cfg.transport} to the {cfg.engine} engine ({cfg.engine_dtype}), "
          f"{cfg.steps} steps", file=sys.stderr)
    with tqdm(total=cfg.steps, desc="RL steps", unit="step", file=sys.stderr) as bar:
        def on_step(row: StepRow) -> None:
            bar.set_postfix(reward=f"{row.reward:.3f}", sync_ms=f"{row.sync_seconds * 1000:.1f}",
                            verified=row.verified)
            bar.update(1)

        result = run_demo(cfg, on_step=on_step)
    print(format_table(result), file=sys.stderr)
    plot = write_plot(result, cfg.out_dir / "demo.png")
    report = write_json(result, cfg.out_dir / "demo.json")
    print(f"plot: {plot}\nreport: {report}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict()))
    ok = all(r.verified for r in result.rows)
    return 0 if ok else 1
