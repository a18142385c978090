"""`weightsync inspect DIR`: the bucket plan of a checkpoint or adapter directory.

Reads only safetensors headers (no tensor data), so it is instant on any size.
"""

from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  weightsync inspect /tmp/tiny
  weightsync inspect /tmp/adapter --bucket-bytes 1MiB
  weightsync inspect /tmp/tiny --json | jq .num_buckets
"""


def parse_bytes(text: str) -> int:
    """'256MiB', '1GiB', '4096', '1e6' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for suffix, factor in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * factor)
    return int(float(t))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="print the bucket plan of a checkpoint or PEFT adapter directory",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", help="directory with *.safetensors (a model, an adapter, or a weightsync version dir)")
    p.add_argument("--bucket-bytes", type=parse_bytes, default=256 << 20, help="bucket budget (default 256MiB)")
    p.add_argument("--json", action="store_true", help="print the plan as a manifest JSON on stdout")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from weightsync.bucketing import plan_buckets
    from weightsync.formats.version_dir import read_checkpoint_metas
    from weightsync.manifest import Manifest

    directory = Path(args.dir)
    try:
        metas = read_checkpoint_metas(directory)
    except (FileNotFoundError, ValueError) as e:
        print(f"weightsync inspect: {e}", file=sys.stderr)
        return 1
    plan = plan_buckets(metas, args.bucket_bytes)
    if args.json:
        print(Manifest(version=0, buckets=plan).to_json())
        return 0
    total = sum(b.nbytes for b in plan)
    print(f"{directory}: {len(metas)} tensors, {total / 2**20:.2f} MiB, "
          f"{len(plan)} bucket(s) of <= {args.bucket_bytes / 2**20:.2f} MiB")
    print(f"{'bucket':>6} {'tensors':>7} {'MiB':>10}  first .. last")
    for b in plan:
        names = b.hf_names
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        print(f"{b.index:>6} {len(names):>7} {b.nbytes / 2**20:>10.3f}  {span}")
    return 0
