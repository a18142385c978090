"""`weightsync bench`: how close to the hardware, and how much faster than what RL
frameworks do today, measured in the same run.

--suite sync (default): a matrix of mode x transport x engine x bucket size
on a dense model and a many-small-tensors (MoE-like) one, next to the
machine's limits for the same bytes (preallocated copy, raw gloo broadcast,
xxh3, loopback TCP, disk) and the baselines (one request per tensor,
checkpoint then reload), the fixed cost of a push (seconds and HTTP round
trips of a push that moves almost nothing, per transport), plus the
trainer's peak memory for merged LoRA.
--suite faults: fault injection and load under pushes (`bench.faults`).

Prints a table and ends with one JSON line (with --json: only the JSON line on
stdout, the table on stderr). Timings are only as good as the machine is
quiet: the load average at start and end is in the report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from weightsync.cli.inspect import parse_bytes

EPILOG = """examples:
  weightsync bench --quick                          # about a minute: 64 MiB models, one bucket size
  weightsync bench                                  # the full matrix on ~0.5 GiB models (10-15 min)
  weightsync bench --transports broadcast,shm --modes full --bucket-bytes 64MiB
  weightsync bench --engines embedded,vllm --model-bytes 256MiB
  weightsync bench --suite faults --quick
  weightsync bench --quick --json > bench.json
"""

QUICK_MODEL_BYTES = 64 << 20
QUICK_BUCKET_BYTES = 16 << 20


def _size(text: str) -> int:
    """A positive size: "512MiB", "1GiB", "1048576" (as `weightsync inspect` reads them)."""
    try:
        value = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 64MiB, 1GiB, 1048576)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def _list(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)} (comma-separated)")
        return items

    return parse


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(_size(x) for x in text.split(",") if x.strip())


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark syncs against the machine's limits and today's baselines",
                       description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=["sync", "faults"], default="sync", help="what to run (default sync)")
    p.add_argument("--quick", action="store_true",
                   help="about a minute: 64 MiB models, one 16 MiB bucket size, 2 pushes per cell, no vLLM")
    p.add_argument("--model-bytes", type=_size, default=None, help="weights per model (default 512MiB)")
    p.add_argument("--bucket-bytes", type=_sizes, default=None,
                   help="comma-separated bucket sizes (default 16MiB,64MiB,256MiB)")
    p.add_argument("--transports", type=_list(("disk", "http", "broadcast", "shm")), default=None,
                   help="comma-separated (default disk,http,broadcast,shm)")
    p.add_argument("--modes", type=_list(("full", "lora", "lora-merged")), default=None,
                   help="comma-separated (default full,lora,lora-merged)")
    p.add_argument("--engines", type=_list(("embedded", "vllm")), default=None,
                   help="comma-separated (default embedded, plus vllm when installed, except with --quick)")
    p.add_argument("--scenarios", type=_list(("dense", "many-small")), default=None,
                   help="comma-separated (default dense,many-small)")
    p.add_argument("--repeats", type=int, default=None, help="measured pushes per cell (default 3, --quick 2)")
    p.add_argument("--engine-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the dtype engines serve; the trainer keeps float32 weights, cast in the stream "
                        "(default float32)")
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="output directory (default runs/bench)")
    p.add_argument("--json", action="store_true", help="only the JSON line on stdout (the table goes to stderr)")


def build_config(args: argparse.Namespace) -> Any:
    """The suite's BenchConfig from the command line."""
    from weightsync.bench.engines import vllm_available
    from weightsync.bench.suite import BenchConfig

    quick = bool(args.quick)
    engines = args.engines or (("embedded",) if quick or not vllm_available() else ("embedded", "vllm"))
    options: dict[str, Any] = dict(out_dir=args.out, quick=quick, engines=engines, engine_dtype=args.engine_dtype)
    if quick:
        options.update(model_bytes=QUICK_MODEL_BYTES, bucket_sizes=(QUICK_BUCKET_BYTES,), repeats=2,
                       limit_repeats=2, vllm_bucket_sizes=(QUICK_BUCKET_BYTES,),
                       memory_methods=("layer-by-layer", "whole-model"))
    if args.model_bytes is not None:
        options["model_bytes"] = args.model_bytes
    if args.bucket_bytes:
        options["bucket_sizes"] = args.bucket_bytes
        options["vllm_bucket_sizes"] = args.bucket_bytes[:1]
    for name in ("transports", "modes", "scenarios"):
        if getattr(args, name):
            options[name] = getattr(args, name)
    if args.repeats is not None:
        if args.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
        options["repeats"] = args.repeats
    return BenchConfig(**options)


def run(args: argparse.Namespace) -> int:
    if args.suite == "faults":
        return _run_faults(args)
    from weightsync.bench.report import format_report, to_json, write_chart
    from weightsync.bench.suite import run_sync_suite

    try:
        config = build_config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table_out = sys.stderr if args.json else sys.stdout

    def progress(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    def on_cell(result: Any) -> None:
        c = result.cell
        what = f"{c.scenario} {c.mode} {c.transport} {c.engine} {c.bucket_bytes >> 20}MiB"
        figure = f"{result.seconds:.3f} s, {result.gbps:.2f} GB/s" if result.ok else f"FAILED: {result.error}"
        progress(f"{what}: {figure}")

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress lines only
    result = run_sync_suite(config, progress=progress, on_cell=on_cell)
    chart = write_chart(result, config.out_dir / "bench.png")
    document = to_json(result)
    document["chart"] = str(chart)
    (config.out_dir / "bench.json").write_text(json.dumps(document, indent=1) + "\n")
    print(format_report(result), file=table_out)
    print(f"chart: {chart}\nreport: {config.out_dir / 'bench.json'}", file=table_out, flush=True)
    print(json.dumps(document), flush=True)
    return 0 if all(c.ok for c in [*result.cells, *result.fixed_cost]) and not result.notes else 1


def _run_faults(args: argparse.Namespace) -> int:
    try:
        from weightsync.bench.faults import format_table, run_faults
    except ModuleNotFoundError as e:
        if e.name != "weightsync.bench.faults":
            raise
        print("error: the faults suite (weightsync.bench.faults) is not in this build yet", file=sys.stderr)
        return 1
    figures = run_faults(quick=bool(args.quick), out_dir=args.out / "faults")
    print(format_table(figures), file=sys.stderr if args.json else sys.stdout, flush=True)
    print(json.dumps(figures, default=str), flush=True)
    return 0
