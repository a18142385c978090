"""The sparse suite: `mode="sparse"` on real RL steps (GRPO-shaped AdamW on fp32 masters into a
bf16 engine), against full pushes of the same weights.

Builds the model, runs the steps and the pushes, and returns per step the fraction of elements
changed, bytes and time against a full push, and the trainer's diff cost against this machine's
copy rate; starting engines is `bench.engines`, printing the caller's. The method:
docs/PERFORMANCE.md ("How the bench measures").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from weightsync_tools.bench.engines import start_engine
from weightsync_tools.bench.limits import measure_copy
from weightsync_tools.bench.scenarios import engine_model_dir, make_scenario, trainer_model

DEFAULT_ENGINE_BYTES = 512 << 20
"""bfloat16 weights the engine serves (the float32 masters are twice that)."""
TRANSPORTS = ("http", "broadcast")
LRS = (1e-6, 1e-5)
BUCKET_BYTES = 64 << 20


@dataclass(frozen=True, kw_only=True)
class SparseStep:
    """One RL step and its sparse push over one transport."""

    transport: str
    lr: float
    step: int
    changed_fraction: float
    """bf16 elements whose bytes changed in this step, over all elements."""
    bytes_ratio: float
    """Bytes sent / bytes of a full push."""
    time_ratio: float
    """This sparse push's seconds / the full push's (best of the full pushes)."""
    sparse_seconds: float
    diff_seconds: float
    diff_core_s_per_gb: float
    """Diff wall seconds x torch threads, per GB of engine-dtype weights."""
    encodings: dict[str, int]
    num_tensors: int
    num_skipped: int
    verified: bool


@dataclass(kw_only=True)
class SparseResult:
    """The whole suite."""

    model: str
    engine_bytes: int
    num_elements: int
    threads: int
    copy_gbps: float
    """This machine's copy rate (float32 masters, bucket-sized chunks), best of 3."""
    copy_core_s_per_gb: float
    """That copy in core-seconds per GB copied (single-threaded copy_)."""
    full_seconds: dict[str, float] = field(default_factory=dict)
    """transport -> best full push of the same model."""
    steps: list[SparseStep] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "steps"},
                "steps": [asdict(s) for s in self.steps]}


def rl_step(model: Any, optimizer: torch.optim.Optimizer, *, vocab: int, seed: int, lr: float,
            batch: int = 2, seq_len: int = 32) -> None:
    """One GRPO-shaped AdamW step: advantage-weighted logprobs of sampled tokens."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    advantages = torch.randn(batch, 1, generator=gen)
    logprobs = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1)
    taken = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-(advantages * taken).mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _cast(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> int:
    return sum(int((before[n].view(torch.int16) != t.view(torch.int16)).sum()) for n, t in after.items())


def run_sparse_suite(*, root: Path, engine_bytes: int = DEFAULT_ENGINE_BYTES,
                     transports: Sequence[str] = TRANSPORTS, lrs: Sequence[float] = LRS,
                     steps_per_lr: int = 3, full_repeats: int = 2, bucket_bytes: int = BUCKET_BYTES,
                     threads: int = 1, progress: Callable[[str], None] = lambda _: None) -> SparseResult:
    """Run the suite (see the module docstring) and return its figures, with `threads`
    torch threads in this process (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(root=root, engine_bytes=engine_bytes, transports=transports, lrs=lrs, steps_per_lr=steps_per_lr,
                    full_repeats=full_repeats, bucket_bytes=bucket_bytes, progress=progress)
    finally:
        torch.set_num_threads(before)


def _run(*, root: Path, engine_bytes: int, transports: Sequence[str], lrs: Sequence[float], steps_per_lr: int,
         full_repeats: int, bucket_bytes: int, progress: Callable[[str], None]) -> SparseResult:
    import weightsync as ws

    scenario = make_scenario("dense", 2 * engine_bytes)  # float32 masters: twice the engine's bytes
    engine_scenario = replace(scenario, model=replace(scenario.model, dtype="bfloat16"))
    model_dir = engine_model_dir(engine_scenario, root / "models")
    num_elements = scenario.num_bytes // 4
    full_bytes = num_elements * 2
    threads = torch.get_num_threads()
    copy_limit = measure_copy(scenario.num_bytes, bucket_bytes)
    copy_seconds = min(copy_limit.runs)
    result = SparseResult(model=engine_scenario.describe(), engine_bytes=full_bytes, num_elements=num_elements,
                          threads=threads, copy_gbps=scenario.num_bytes / copy_seconds / 1e9,
                          copy_core_s_per_gb=copy_seconds / (scenario.num_bytes / 1e9))
    progress(f"model: {result.model}; copy {result.copy_gbps:.2f} GB/s; torch threads {threads}")
    vocab = scenario.model.vocab_size
    with start_engine("embedded", model_dir, disk_root=root / "disk") as engine:
        for transport in transports:
            model = trainer_model(scenario).train()
            optimizer = torch.optim.AdamW(model.parameters(), lr=lrs[0])
            options: dict[str, Any] = dict(transport=transport, bucket_bytes=bucket_bytes, timeout_s=300.0,
                                           disk_root=str(root / "disk"))
            with ws.WeightSync([engine.client], mode="full", **options) as full:
                runs = [full.push(model, version=engine.next_version()).seconds for _ in range(full_repeats)]
            result.full_seconds[transport] = min(runs)
            progress(f"{transport}: full push {min(runs):.3f} s (runs {', '.join(f'{r:.3f}' for r in runs)})")
            with ws.WeightSync([engine.client], mode="sparse", **options) as sparse:
                first = sparse.push(model, version=engine.next_version())
                assert first.mode == "full", first
                before = _cast(model)
                step = 0
                for lr in lrs:
                    for _ in range(steps_per_lr):
                        t0 = time.perf_counter()
                        rl_step(model, optimizer, vocab=vocab, seed=step, lr=lr)
                        train_s = time.perf_counter() - t0
                        report = sparse.push(model, version=engine.next_version())
                        after = _cast(model)
                        changed = _changed(before, after)
                        before = after
                        row = SparseStep(
                            transport=transport, lr=lr, step=step, changed_fraction=changed / num_elements,
                            bytes_ratio=report.num_bytes / full_bytes,
                            time_ratio=report.seconds / result.full_seconds[transport],
                            sparse_seconds=report.seconds, diff_seconds=report.stages.diff,
                            diff_core_s_per_gb=report.stages.diff * threads / (full_bytes / 1e9),
                            encodings=dict(report.encodings), num_tensors=report.num_tensors,
                            num_skipped=report.num_skipped, verified=report.verified)
                        result.steps.append(row)
                        progress(f"{transport} lr {lr:g} step {step} (train {train_s:.1f} s): "
                                 f"{row.changed_fraction:.2%} changed, bytes {row.bytes_ratio:.3f} of full, "
                                 f"time {row.time_ratio:.3f} of full ({report.seconds:.3f} s, diff "
                                 f"{report.stages.diff:.3f} s), {dict(report.encodings)}")
                        step += 1
            del optimizer, model
    return result


def format_table(result: SparseResult) -> str:
    """The per-step table, with the machine's copy rate above it."""
    lines = [
        f"sparse suite: {result.model}",
        f"engine bf16 {result.engine_bytes / 2**20:.0f} MiB, {result.num_elements / 1e6:.0f}M elements; "
        f"copy {result.copy_gbps:.2f} GB/s = {result.copy_core_s_per_gb:.3f} core-s/GB (1 thread); "
        f"torch threads {result.threads}",
        "full push: " + ", ".join(f"{t} {s:.3f} s" for t, s in result.full_seconds.items()),
        f"{'transport':<10} {'lr':>6} {'step':>4} {'changed':>8} {'bytes/full':>10} {'time/full':>9} "
        f"{'push s':>7} {'diff s':>7} {'diff core-s/GB':>14}  encodings",
    ]
    for s in result.steps:
        lines.append(f"{s.transport:<10} {s.lr:>6g} {s.step:>4} {s.changed_fraction:>8.2%} {s.bytes_ratio:>10.4f} "
                     f"{s.time_ratio:>9.3f} {s.sparse_seconds:>7.3f} {s.diff_seconds:>7.3f} "
                     f"{s.diff_core_s_per_gb:>14.3f}  {s.encodings}")
    return "\n".join(lines)


__all__ = ["SparseResult", "SparseStep", "format_table", "rl_step", "run_sparse_suite"]
