"""What `weightsync demo` runs once `weightsync.cli.demo` parsed its arguments: the
RL loop with a progress bar, then the table, the plot and the JSON report."""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from weightsync_tools.demo import DemoConfig, StepRow, run_demo
from weightsync_tools.demo.report import format_table, write_json, write_plot


def run(args: argparse.Namespace) -> int:
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
