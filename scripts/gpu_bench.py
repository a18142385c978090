"""The GPU bench of scripts/gpu_run.sh: per size, the device-to-device copy rate (the ceiling a
CUDA IPC push is held against), the wsmix64 digest on the device (its share of a push), and an
engine process mapping the trainer's CUDA IPC slots and copying them into its own GPU memory,
digest checked on the device. Prints one JSON object; on a machine without CUDA it says so.

    python scripts/gpu_bench.py [--sizes-mib 256,1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

ENGINE = """
import json, sys, time, torch
from types import SimpleNamespace
from weightsync.digests import digest
from weightsync.links import Delivery, Link
from weightsync.transports.shm import ShmReceiver
spec = json.loads(sys.stdin.read())
link = Link.from_dict(spec["link"])
r = ShmReceiver(); r.join(link, rank=0)
into = torch.empty(spec["nbytes"], dtype=torch.uint8, device="cuda")
times, digest_times, hashed = [], [], None
for _ in range(spec["repeats"] + 1):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    _, hashed = r.fetch_hashed(link, SimpleNamespace(index=0, nbytes=spec["nbytes"]),
                               Delivery(transport="shm", slot=0), into, "wsmix64")
    torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
    slot = r._slot(link, SimpleNamespace(index=0, nbytes=spec["nbytes"]), Delivery(transport="shm", slot=0))
    t0 = time.perf_counter(); digest(slot, "wsmix64"); torch.cuda.synchronize()
    digest_times.append(time.perf_counter() - t0)
r.close()
print(json.dumps({"seconds": times[1:], "digest_seconds": digest_times[1:], "digest": hashed}))
"""


def timed(fn: Any, repeats: int) -> list[float]:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def bench_size(nbytes: int, repeats: int) -> dict[str, Any]:
    from weightsync.digests import WSMIX64, digest
    from weightsync.transports.shm import ShmTransport

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = statistics.median(timed(lambda: dst.copy_(src), repeats))
    digest_s = statistics.median(timed(lambda: digest(src, WSMIX64), repeats))
    row: dict[str, Any] = {"bytes": nbytes, "d2d_copy_s": copy_s, "d2d_copy_GBps": nbytes / copy_s / 1e9,
                           "device_digest_s": digest_s, "device_digest_GBps": nbytes / digest_s / 1e9}
    transport = ShmTransport(cuda_ipc=True)
    try:
        (link,) = transport.open([1], max_bucket_bytes=nbytes)
        transport.begin(SimpleNamespace(buckets=[0]))  # type: ignore[arg-type]
        slot = transport.slot(0, nbytes)
        slot.copy_(src)
        transport.deliver(SimpleNamespace(index=0, nbytes=nbytes), slot)  # type: ignore[arg-type]
        spec = {"link": link.to_dict(), "nbytes": nbytes, "repeats": repeats}
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", ENGINE], input=json.dumps(spec), capture_output=True,
                              text=True, timeout=240)
        row["engine_process_s"] = time.monotonic() - started
        if done.returncode != 0:
            row["ipc_error"] = done.stderr[-2000:]
            return row
        got = json.loads(done.stdout.strip().splitlines()[-1])
        ipc_s = statistics.median(got["seconds"])
        row.update(ipc_fetch_hashed_s=ipc_s, ipc_fetch_hashed_GBps=nbytes / ipc_s / 1e9,
                   ipc_vs_d2d_copy=copy_s / ipc_s, ipc_digest_share=statistics.median(got["digest_seconds"]) / ipc_s,
                   ipc_digest_matches=got["digest"] == digest(src.cpu(), WSMIX64))
    finally:
        transport.close()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mib", default="64,256,1024")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device (torch.cuda.is_available() is False)"}))
        return 0
    props = torch.cuda.get_device_properties(0)
    out: dict[str, Any] = {"device": props.name, "gpu_uuid": str(props.uuid), "torch": torch.__version__,
                           "rows": []}
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        try:
            out["rows"].append(bench_size(mib << 20, args.repeats))
        except Exception as e:  # one size failing still reports the others
            out["rows"].append({"bytes": mib << 20, "error": f"{type(e).__name__}: {e}"})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
