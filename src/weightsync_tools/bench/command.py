"""What `weightsync bench` runs once `weightsync.cli.bench` parsed its arguments:
the sync suite (table, chart, JSON), the faults, sparse, per-tensor, engine-memory or quantized suite."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

QUICK_MODEL_BYTES = 64 << 20
QUICK_BUCKET_BYTES = 16 << 20


def build_config(args: argparse.Namespace) -> Any:
    """The suite's BenchConfig from the command line."""
    from weightsync_tools.bench.engines import vllm_available
    from weightsync_tools.bench.suite import BenchConfig

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
    if args.suite == "sparse":
        return _run_sparse(args)
    if args.suite == "sparse-fsdp":
        return _run_sparse_fsdp(args)
    if args.suite == "per-tensor":
        return _run_per_tensor(args)
    if args.suite == "engine-memory":
        return _run_engine_memory(args)
    if args.suite == "quantized":
        from weightsync_tools.bench.quantized import run_command

        return run_command(args)
    from weightsync_tools.bench.report import format_report, to_json, write_chart
    from weightsync_tools.bench.suite import run_sync_suite

    try:
        config = build_config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table_out = sys.stderr if args.json else sys.stdout

    def on_cell(result: Any) -> None:
        c = result.cell
        what = f"{c.scenario} {c.mode} {c.transport} {c.engine} {c.bucket_bytes >> 20}MiB"
        figure = f"{result.seconds:.3f} s, {result.gbps:.2f} GB/s" if result.ok else f"FAILED: {result.error}"
        progress(f"{what}: {figure}")

    quiet_transformers()
    result = run_sync_suite(config, progress=progress, on_cell=on_cell)
    chart = write_chart(result, config.out_dir / "bench.png")
    document = to_json(result)
    document["chart"] = str(chart)
    (config.out_dir / "bench.json").write_text(json.dumps(document, indent=1) + "\n")
    print(format_report(result), file=table_out)
    print(f"chart: {chart}\nreport: {config.out_dir / 'bench.json'}", file=table_out, flush=True)
    print(json.dumps(document), flush=True)
    return 0 if all(c.ok for c in [*result.cells, *result.fixed_cost]) and not result.notes else 1


def progress(message: str) -> None:
    """A progress line of the bench, on stderr (stdout holds the tables and the JSON line)."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def quiet_transformers() -> None:
    """Our own progress lines only: no progress bars from transformers' loading."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def suite_root(args: argparse.Namespace, name: str) -> Path:
    """The suite's directory under --out, made."""
    root = Path(args.out) / name
    root.mkdir(parents=True, exist_ok=True)
    return root


def _run_faults(args: argparse.Namespace) -> int:
    from weightsync_tools.faults import format_table, run_faults

    figures = run_faults(quick=bool(args.quick), out_dir=args.out / "faults")
    print(format_table(figures), file=sys.stderr if args.json else sys.stdout, flush=True)
    print(json.dumps(figures, default=str), flush=True)
    return 0


def _run_sparse(args: argparse.Namespace) -> int:
    from weightsync_tools.bench.sparse import DEFAULT_ENGINE_BYTES, TRANSPORTS, format_table, run_sparse_suite

    quiet_transformers()
    options: dict[str, Any] = dict(
        root=args.out / "sparse", transports=args.transports or TRANSPORTS,
        engine_bytes=args.model_bytes or (QUICK_MODEL_BYTES if args.quick else DEFAULT_ENGINE_BYTES),
        steps_per_lr=1 if args.quick else 3, full_repeats=args.repeats or 2)
    if args.bucket_bytes:
        options["bucket_bytes"] = args.bucket_bytes[0]
    result = run_sparse_suite(progress=progress, **options)
    print(format_table(result), file=sys.stderr if args.json else sys.stdout, flush=True)
    print(json.dumps(result.to_dict()), flush=True)
    return 0 if all(s.verified for s in result.steps) else 1


def _run_sparse_fsdp(args: argparse.Namespace) -> int:
    from weightsync_tools.bench.sparse_fsdp import DEFAULT_ENGINE_BYTES, format_table, run_sparse_fsdp_suite

    quiet_transformers()
    root = suite_root(args, "sparse-fsdp")
    result = run_sparse_fsdp_suite(
        root=root, engine_bytes=args.model_bytes or (QUICK_MODEL_BYTES if args.quick else DEFAULT_ENGINE_BYTES),
        steps_per_lr=1 if args.quick else 2, full_repeats=args.repeats or 2, progress=progress)
    print(format_table(result), file=sys.stderr if args.json else sys.stdout, flush=True)
    print(json.dumps(result.to_dict()), flush=True)
    return 0 if all(s["verified"] for s in result.steps) else 1


def _run_per_tensor(args: argparse.Namespace) -> int:
    from weightsync_tools.bench.per_tensor import (
        BUCKET_BYTES,
        SCENARIOS,
        TRANSPORTS,
        format_table,
        run_per_tensor_suite,
    )

    if args.trainer_threads is not None and args.trainer_threads < 1:
        print(f"error: --trainer-threads must be at least 1, got {args.trainer_threads}", file=sys.stderr)
        return 2
    quiet_transformers()
    root = suite_root(args, "per-tensor")
    result = run_per_tensor_suite(
        root=root, model_bytes=args.model_bytes or (QUICK_MODEL_BYTES if args.quick else 512 << 20),
        bucket_bytes=args.bucket_bytes[0] if args.bucket_bytes else BUCKET_BYTES,
        transports=args.transports or TRANSPORTS, scenarios=args.scenarios or SCENARIOS,
        repeats=args.repeats or (2 if args.quick else 5), trainer_threads=args.trainer_threads, progress=progress)
    print(format_table(result), file=sys.stderr if args.json else sys.stdout, flush=True)
    print(json.dumps(result.to_dict()), flush=True)
    return 0 if not result.errors and all(p.verified for p in result.pushes) else 1


def _run_engine_memory(args: argparse.Namespace) -> int:
    from weightsync_tools.bench.engine_memory import (
        DEFAULT_BUCKET_BYTES,
        DEFAULT_MODEL_BYTES,
        format_table,
        run_engine_memory_suite,
    )

    engines = None
    if args.engines:
        engines = tuple(e for kind in args.engines for e in (("vllm-tp1", "vllm-tp2") if kind == "vllm" else (kind,)))
    quiet_transformers()
    result = run_engine_memory_suite(
        root=suite_root(args, "engine-memory"), model_bytes=args.model_bytes or DEFAULT_MODEL_BYTES,
        bucket_bytes=args.bucket_bytes[0] if args.bucket_bytes else DEFAULT_BUCKET_BYTES, engines=engines,
        transports=args.transports, progress=progress)
    print(format_table(result), file=sys.stderr if args.json else sys.stdout, flush=True)
    print(json.dumps(result.to_dict()), flush=True)
    return 0 if not result.notes else 1
