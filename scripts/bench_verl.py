"""What one verl update costs through the `"weightsync"` checkpoint-engine backend, without Ray.

Four spawned processes stand for verl's workers: two actor ranks (each yields the same
float32 tensors, as verl's FSDP generator yields gathered ones; rank 0 is `is_master`) and
two rollout workers (each consumes `receive_weights()` whole, `hold_update` on). Each
round is verl's manager sequence: `prepare` everywhere, `build_topology`,
`init_process_group`, `send_weights` beside `receive_weights`, `finalize`. The weights are
made before the round, so the update's time is the backend's: plan, cast to bfloat16, pack,
hash, move, check, yield.

    PYTHONPATH=src python scripts/bench_verl.py --transport broadcast shm disk --rounds 3

Prints a table (seconds per phase, MB/s of bfloat16 bytes over the send/receive phase) and
ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import tempfile
import time
from typing import Any


def _worker(is_master: bool, bucket_bytes: int, num_tensors: int, numel: int, inbox: Any, outbox: Any) -> None:
    import torch
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import weightsync.integrations.verl  # noqa: F401  (registers the backend, as custom_backend_module does)

    torch.set_num_threads(1)
    weights: list[tuple[str, torch.Tensor]] = []
    engine: Any = None
    while True:
        command, *args = inbox.get()
        if command == "stop":
            return
        started = time.perf_counter()
        result: Any = None
        if command == "build":
            engine = CheckpointEngineRegistry.new("weightsync", bucket_size=bucket_bytes, is_master=is_master,
                                                  **args[0])
        elif command == "weights":
            generator = torch.Generator().manual_seed(args[0])
            weights = [(f"layers.{i}.weight", torch.randn(numel, generator=generator)) for i in range(num_tensors)]
        elif command == "prepare":
            result = engine.prepare()
        elif command == "init":
            engine.init_process_group(**args[0])
        elif command == "send":
            result = asyncio.run(engine.send_weights(iter(weights), global_steps=args[0]))
        elif command == "receive":
            result = asyncio.run(_consume(engine, args[0]))
        elif command == "finalize":
            engine.finalize()
        outbox.put((result, time.perf_counter() - started))


async def _consume(engine: Any, global_steps: int) -> int:
    """Take every tensor `receive_weights` yields, as verl's server adapter does; their elements."""
    return sum([t.numel() async for _, t in engine.receive_weights(global_steps=global_steps)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", nargs="+", default=["broadcast", "shm", "disk"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tensors", type=int, default=48, help="float32 tensors per update (default 48)")
    parser.add_argument("--numel", type=int, default=2 << 20, help="elements per tensor (default 2M: 8 MB)")
    parser.add_argument("--bucket-mb", type=int, default=16, help="verl's update_weights_bucket_megabytes")
    options = parser.parse_args()
    from weightsync.integrations.verl import WeightSyncCheckpointEngine

    context = mp.get_context("spawn")
    workers = []
    for is_master in (True, False, False, False):  # actor 0, actor 1, rollout 0, rollout 1
        inbox, outbox = context.Queue(), context.Queue()
        process = context.Process(target=_worker, args=(is_master, options.bucket_mb << 20, options.tensors,
                                                        options.numel, inbox, outbox))
        process.start()
        workers.append((process, inbox, outbox))

    def everyone(*commands: tuple[Any, ...]) -> list[tuple[Any, float]]:
        for (_, inbox, _), command in zip(workers, commands, strict=True):
            inbox.put(command)
        return [outbox.get() for _, _, outbox in workers]

    rows: list[dict[str, Any]] = []
    step = 0
    with tempfile.TemporaryDirectory(prefix="bench-verl-") as disk_root:
        for transport in options.transport:
            everyone(*[("build", {"transport": transport, "disk_root": disk_root})] * 4)
            for _ in range(options.rounds):
                step += 1
                everyone(*[("weights", step)] * 4)
                t0 = time.perf_counter()
                metadata = [m for m, _ in everyone(*[("prepare",)] * 4)]
                actor_kwargs, rollout_kwargs = WeightSyncCheckpointEngine.build_topology(2, 2, metadata)
                kwargs = [{k: v[i] for k, v in actor_kwargs.items()} for i in range(2)]
                kwargs += [{k: v[i] for k, v in rollout_kwargs.items()} for i in range(2)]
                t1 = time.perf_counter()
                everyone(*[("init", k) for k in kwargs])
                t2 = time.perf_counter()
                out = everyone(("send", step), ("send", step), ("receive", step), ("receive", step))
                t3 = time.perf_counter()
                everyone(*[("finalize",)] * 4)
                t4 = time.perf_counter()
                metrics = out[0][0]
                rows.append({"transport": transport, "round": step, "prepare_s": round(t1 - t0, 3),
                             "init_s": round(t2 - t1, 3), "update_s": round(t3 - t2, 3),
                             "finalize_s": round(t4 - t3, 3), "bytes": metrics["weightsync/bytes"],
                             "buckets": metrics["weightsync/buckets"], "pack_s": metrics["weightsync/pack_s"],
                             "hash_s": metrics["weightsync/hash_s"], "wire_s": metrics["weightsync/wire_s"],
                             "mb_per_s": round(metrics["weightsync/bytes"] / (t3 - t2) / 1e6, 1)})
    for _, inbox, _ in workers:
        inbox.put(("stop",))
    for process, _, _ in workers:
        process.join()
    columns = ["transport", "round", "prepare_s", "init_s", "update_s", "finalize_s", "buckets", "pack_s",
               "hash_s", "wire_s", "mb_per_s"]
    print(" ".join(f"{c:>10}" for c in columns))
    for row in rows:
        print(" ".join(f"{row[c]:>10}" for c in columns))
    print(json.dumps({"machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
                      "tensors": options.tensors, "numel": options.numel, "bucket_mb": options.bucket_mb,
                      "rows": rows}))


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
