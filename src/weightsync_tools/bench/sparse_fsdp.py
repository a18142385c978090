"""The sparse suite on a sharded trainer: `mode="sparse"` from FSDP2 ranks against `mode="full"`
from the same ranks.

Spawns the ranks (gloo over a file store, one torch thread each) and starts the engine; returns per
step bytes and time against a full push and the sending rank's diff seconds, beside this machine's
gloo rate. The caller prints. The method: docs/PERFORMANCE.md ("How the bench measures").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from weightsync_tools.bench.engines import start_engine
from weightsync_tools.bench.limits import measure_gloo
from weightsync_tools.bench.scenarios import engine_model_dir, make_scenario, trainer_model
from weightsync_tools.bench.sparse import BUCKET_BYTES, LRS, rl_step

DEFAULT_ENGINE_BYTES = 128 << 20
"""bfloat16 weights the engine serves: each rank also holds its shard of the fp32
masters and two AdamW states, and trains on one thread."""


@dataclass(kw_only=True)
class ShardedSparseResult:
    model: str
    ranks: int
    engine_bytes: int
    gloo_gbps: float
    """This machine's gloo broadcast rate between two local processes, same run."""
    full_seconds: float = 0.0
    """Best full push from the ranks (every weight all-gathered in fp32)."""
    first_sparse_seconds: float = 0.0
    """The sparse sync's first push (whole, gathered from bf16 snapshot rows)."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """Per step: lr, bytes_ratio, time_ratio, seconds, diff_seconds, encodings, verified."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_sparse_fsdp_suite(*, root: Path, engine_bytes: int = DEFAULT_ENGINE_BYTES, ranks: int = 2,
                          lrs: Sequence[float] = LRS, steps_per_lr: int = 2, full_repeats: int = 2,
                          progress: Callable[[str], None] = lambda _: None) -> ShardedSparseResult:
    """Run the suite (see the module docstring) and return its figures."""
    import torch.multiprocessing as mp

    scenario = make_scenario("dense", 2 * engine_bytes)
    engine_scenario = replace(scenario, model=replace(scenario.model, dtype="bfloat16"))
    model_dir = engine_model_dir(engine_scenario, root / "models")
    gloo = measure_gloo(min(engine_bytes, 64 << 20), min(engine_bytes, 64 << 20))
    result = ShardedSparseResult(model=engine_scenario.describe(), ranks=ranks, engine_bytes=engine_bytes,
                                 gloo_gbps=gloo.gbps)
    progress(f"model: {result.model}; {ranks} FSDP2 ranks; gloo {result.gloo_gbps:.2f} GB/s")
    out = root / "sparse-fsdp.json"
    out.unlink(missing_ok=True)
    store = root / "rendezvous"
    store.unlink(missing_ok=True)
    with start_engine("embedded", model_dir, disk_root=root / "disk") as engine:
        first = engine.next_version()
        mp.start_processes(_rank, args=(ranks, str(store), engine.url, scenario, list(lrs), steps_per_lr,
                                        full_repeats, first, str(out)), nprocs=ranks, start_method="spawn")
    figures = json.loads(out.read_text())
    result.full_seconds, result.first_sparse_seconds = figures["full_seconds"], figures["first_sparse_seconds"]
    result.steps = figures["steps"]
    for s in result.steps:
        progress(f"lr {s['lr']:g}: bytes {s['bytes_ratio']:.3f} of full, time {s['time_ratio']:.3f} of full "
                 f"({s['seconds']:.3f} s, diff {s['diff_seconds']:.3f} s), {s['encodings']}")
    return result


def _rank(rank: int, world_size: int, store: str, url: str, scenario: Any, lrs: list[float], steps_per_lr: int,
          full_repeats: int, first_version: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import weightsync as ws

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    model = trainer_model(scenario).train()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lrs[0])
    engine = ws.SGLangEngine(url, timeout_s=300)
    options: dict[str, Any] = dict(bucket_bytes=BUCKET_BYTES, timeout_s=300.0, process_group=dist.group.WORLD)
    version = first_version
    with ws.WeightSync([engine], mode="full", **options) as full:
        runs = []
        for _ in range(full_repeats):
            runs.append(full.push(model, version=version).seconds)
            version += 1
    figures: dict[str, Any] = {"full_seconds": min(runs), "steps": []}
    with ws.WeightSync([engine], mode="sparse", **options) as sparse:
        figures["first_sparse_seconds"] = sparse.push(model, version=version).seconds
        step = 0
        for lr in lrs:
            for _ in range(steps_per_lr):
                rl_step(model, optimizer, vocab=scenario.model.vocab_size, seed=1000 * step + rank, lr=lr)
                version += 1
                report = sparse.push(model, version=version)
                figures["steps"].append({
                    "lr": lr, "step": step, "bytes_ratio": report.num_bytes / (scenario.num_bytes // 2),
                    "time_ratio": report.seconds / figures["full_seconds"], "seconds": report.seconds,
                    "diff_seconds": report.stages.diff, "encodings": dict(report.encodings),
                    "mode": report.mode, "verified": report.verified})
                step += 1
    if rank == 0:
        Path(out).write_text(json.dumps(figures))
    dist.destroy_process_group()


def format_table(result: ShardedSparseResult) -> str:
    lines = [
        f"sparse suite, FSDP2: {result.model}; {result.ranks} ranks (gloo {result.gloo_gbps:.2f} GB/s, same run)",
        f"full push {result.full_seconds:.3f} s (fp32 all-gather per weight); first sparse push (whole, from bf16 "
        f"rows) {result.first_sparse_seconds:.3f} s",
        f"{'lr':>6} {'step':>4} {'mode':>6} {'bytes/full':>10} {'time/full':>9} {'push s':>7} {'diff s':>7}  encodings",
    ]
    for s in result.steps:
        lines.append(f"{s['lr']:>6g} {s['step']:>4} {s['mode']:>6} {s['bytes_ratio']:>10.4f} {s['time_ratio']:>9.3f} "
                     f"{s['seconds']:>7.3f} {s['diff_seconds']:>7.3f}  {s['encodings']}")
    return "\n".join(lines)


__all__ = ["ShardedSparseResult", "format_table", "run_sparse_fsdp_suite"]
