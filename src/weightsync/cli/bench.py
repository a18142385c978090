"""`weightsync bench`: how close to the hardware, and how much faster than what RL
frameworks do today, measured in the same run.

`--suite` picks the measurement (`DESCRIPTION` lists them; docs/PERFORMANCE.md, "How the bench
measures", says what each does). Prints a table and ends with one JSON line (with --json: only
the JSON line on stdout, the table on stderr), the load average at start and end included.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from weightsync.cli.inspect import parse_bytes
from weightsync.cli.tools import tools_installed
from weightsync.manifest import MODES
from weightsync.transports import TRANSPORTS

DESCRIPTION = """`weightsync bench`: how close to the hardware, and how much faster than what RL
frameworks do today, measured in the same run.

--suite sync (default): a matrix of mode x transport x engine x bucket size
on a dense model and a many-small-tensors (MoE-like) one, next to the
machine's limits for the same bytes (preallocated copy, raw gloo broadcast,
xxh3, loopback TCP, disk) and the baselines (one request per tensor,
checkpoint then reload), the fixed cost of a push (seconds and HTTP round
trips of a push that moves almost nothing, per transport), plus the
trainer's peak memory for merged LoRA (when lora-merged is among --modes).
--suite faults: fault injection and load under pushes (`weightsync_tools.faults`).
--suite sparse: mode="sparse" on real RL steps against full pushes of the same weights.
--suite sparse-fsdp: the same from 2 FSDP2 ranks (each diffs its own shard).
--suite per-tensor: models of many small tensors (many-small; moe-30k, 30,003
tensors) against a dense model of the same bytes: push time ratio, microseconds
per tensor, manifest size, the trainer's peak memory beyond the model.
--suite engine-memory: each engine's memory beyond the model during the second of two
full pushes (weightsync serve over shm and http; vLLM TP=1 and TP=2 over shm when
installed), peak and kept, in model copies: from the engine's ack and from the Pss
of its processes (default 204MiB float32 model, 32MiB buckets).
--suite quantized: one fp32 dense model pushed as bf16, int8 per channel and fp8 blocks
into an in-process engine stand-in: bytes on the wire (weights, scales), the trainer's
quantizing or casting pass alone, the push's time (default 256MiB, 64MiB buckets).

Prints a table and ends with one JSON line (with --json: only the JSON line on
stdout, the table on stderr). Timings are only as good as the machine is
quiet: the load average at start and end is in the report.
"""
"""`weightsync bench --help`'s description: the suites, one by one."""

EPILOG = """examples:
  weightsync bench --quick                          # about a minute: 64 MiB models, one bucket size
  weightsync bench                                  # the full matrix on ~0.5 GiB models (10-15 min)
  weightsync bench --transports broadcast,shm --modes full --bucket-bytes 64MiB
  weightsync bench --engines embedded,vllm --model-bytes 256MiB
  weightsync bench --suite faults --quick
  weightsync bench --suite sparse                   # fp32 AdamW steps at lr 1e-6, 1e-5 into a bf16 engine
  weightsync bench --suite sparse-fsdp              # the same from 2 FSDP2 ranks (128 MiB bf16 by default)
  weightsync bench --suite per-tensor               # many small tensors vs dense, same bytes (shm, broadcast)
  weightsync bench --suite engine-memory            # engine peak and kept memory of a push, every engine
  weightsync bench --suite engine-memory --engines embedded --model-bytes 32MiB --bucket-bytes 4MiB
  weightsync bench --suite quantized                # bf16 vs int8 vs fp8 pushes: bytes, quantizing time
  weightsync bench --quick --json > bench.json
"""

BENCH_MODES = tuple(m for m in MODES if m not in ("delta", "sparse"))
"""Every mode but "delta" and "sparse": the matrix pushes the same weights again and
again, so they would move nothing (`--suite sparse` measures sparse on real RL steps)."""


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
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=["sync", "faults", "sparse", "sparse-fsdp", "per-tensor", "engine-memory",
                                        "quantized"],
                   default="sync",
                   help="what to run (default sync; sparse: mode='sparse' on real RL steps against full pushes, "
                        "--model-bytes then sizes the bf16 engine, default 512MiB; sparse-fsdp: the same from 2 "
                        "FSDP2 ranks, default 128MiB; per-tensor: many small tensors against dense, same bytes, "
                        "default scenarios many-small,moe-30k over shm,broadcast, 64MiB buckets; engine-memory: "
                        "every engine's peak and kept memory of a push, default 204MiB, 32MiB buckets, vllm meaning "
                        "TP=1 and TP=2; quantized: bf16, int8 and fp8 pushes of one fp32 model, default 256MiB, 64MiB "
                        "buckets)")
    p.add_argument("--quick", action="store_true",
                   help="about a minute: 64 MiB models, one 16 MiB bucket size, 2 pushes per cell, no vLLM")
    p.add_argument("--model-bytes", type=_size, default=None, help="weights per model (default 512MiB)")
    p.add_argument("--bucket-bytes", type=_sizes, default=None,
                   help="comma-separated bucket sizes (default 16MiB,64MiB,256MiB)")
    p.add_argument("--transports", type=_list(TRANSPORTS), default=None,
                   help=f"comma-separated (default {','.join(TRANSPORTS)})")
    p.add_argument("--modes", type=_list(BENCH_MODES), default=None,
                   help=f"comma-separated (default {','.join(BENCH_MODES)})")
    p.add_argument("--engines", type=_list(("embedded", "vllm")), default=None,
                   help="comma-separated (default embedded, plus vllm when installed, except with --quick)")
    p.add_argument("--scenarios", type=_list(("dense", "many-small", "moe-30k")), default=None,
                   help="comma-separated (default dense,many-small; moe-30k: 30,003 tensors of ~18 KB)")
    p.add_argument("--repeats", type=int, default=None, help="measured pushes per cell (default 3, --quick 2)")
    p.add_argument("--engine-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the dtype engines serve; the trainer keeps float32 weights, cast in the stream "
                        "(default float32)")
    p.add_argument("--trainer-threads", type=int, default=None,
                   help="per-tensor, quantized: torch's intra-op threads in the trainer's process (default torch's, "
                        "one per core; the engine runs one)")
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="output directory (default runs/bench)")
    p.add_argument("--json", action="store_true", help="only the JSON line on stdout (the table goes to stderr)")


def run(args: argparse.Namespace) -> int:
    if not tools_installed("bench"):
        return 1
    from weightsync_tools.bench.command import run as run_bench

    return run_bench(args)
