"""What the suite's raw figures mean: fraction of the relevant limit, speed-up over each baseline,
digest share, the work floor, and the targets, met or not.

Pure: a `BenchResult` in, numbers out; nothing here measures or prints (`report` prints). How each
figure is defined: docs/PERFORMANCE.md ("How the bench measures").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from weightsync_tools.bench.matrix import CellResult
from weightsync_tools.bench.suite import BenchResult

LIMIT_OF_TRANSPORT = {"broadcast": "gloo", "shm": "copy", "http": "tcp", "disk": "disk"}
WORK = {  # (stage, limit, side) for each pass over the bytes a verified full push makes
    "shm": (("pack", "copy", "trainer"), ("hash", "xxh3", "trainer"), ("engine hash", "xxh3", "engine")),
    "broadcast": (("pack", "copy", "trainer"), ("hash", "xxh3", "trainer"), ("move", "gloo", "both"),
                  ("engine hash", "xxh3", "engine")),
    "http": (("pack", "copy", "trainer"), ("hash", "xxh3", "trainer"), ("move", "tcp", "both"),
             ("engine copy", "copy", "engine"), ("engine hash", "xxh3", "engine")),
}
"""The engine hashes while it copies (`digests.copy_hashed`), still one hash's work; over
shm the embedded engine copies nothing: it hashes the slot in place and serves from it
(`transports.shm`, adoption)."""
PER_TENSOR = ("per-tensor-broadcast", "per-tensor-http")


@dataclass(frozen=True, kw_only=True)
class CellView:
    """A cell with its derived figures."""

    result: CellResult
    limit_name: str | None = None
    limit_seconds: float | None = None
    limit_fraction: float | None = None
    """limit seconds / sync seconds."""
    speedups: dict[str, float] = field(default_factory=dict)
    """baseline name -> baseline seconds / sync seconds."""
    digest_share: float | None = None
    """(trainer hash + engine re-hash) / sync seconds: an upper bound."""
    engine_rehash_share: float | None = None
    """Engine re-hash alone / sync seconds (on the critical path; the trainer's hash overlaps the wire)."""

    def to_dict(self) -> dict[str, Any]:
        return {**self.result.to_dict(), "limit": self.limit_name, "limit_seconds": self.limit_seconds,
                "limit_fraction": self.limit_fraction, "speedups": dict(self.speedups),
                "digest_share": self.digest_share, "engine_rehash_share": self.engine_rehash_share}


@dataclass(frozen=True, kw_only=True)
class Target:
    """One of the issue's targets on this run."""

    name: str
    goal: str
    """The target in words."""
    threshold: float
    measured: float | None
    """None: not measured in this run."""
    higher_is_better: bool = True
    detail: str = ""

    @property
    def met(self) -> bool | None:
        if self.measured is None or math.isnan(self.measured):
            return None
        return self.measured >= self.threshold if self.higher_is_better else self.measured < self.threshold

    @property
    def verdict(self) -> str:
        return {True: "met", False: "NOT MET", None: "not measured"}[self.met]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "goal": self.goal, "threshold": self.threshold, "measured": self.measured,
                "met": self.met, "detail": self.detail}


def cell_views(result: BenchResult) -> list[CellView]:
    return [_view(cell, result) for cell in result.cells]


def _view(cell: CellResult, result: BenchResult) -> CellView:
    if not cell.ok:
        return CellView(result=cell)
    c = cell.cell
    limits = result.limits.get((c.scenario, c.bucket_bytes), {})
    limit_name = LIMIT_OF_TRANSPORT.get(c.transport)
    limit = limits.get(limit_name) if limit_name else None
    speedups = {b.name: b.seconds / cell.seconds for b in result.baselines.get(c.scenario, [])}
    xxh3 = limits.get("xxh3")
    share = engine_share = None
    if xxh3 is not None:
        engine_rehash = cell.num_bytes / (xxh3.gbps * 1e9)
        share = (cell.stages.get("hash", 0.0) + engine_rehash) / cell.seconds
        engine_share = engine_rehash / cell.seconds
    # The limit's time for this cell's bytes (a LoRA cell moves far fewer than the model).
    limit_seconds = limit.seconds * cell.num_bytes / limit.num_bytes if limit else None
    return CellView(result=cell, limit_name=limit_name if limit else None, limit_seconds=limit_seconds,
                    limit_fraction=limit_seconds / cell.seconds if limit_seconds is not None else None,
                    speedups=speedups, digest_share=share, engine_rehash_share=engine_share)


@dataclass(frozen=True, kw_only=True)
class Floor:
    """The passes a verified full push over `transport` makes, at this run's limits."""

    scenario: str
    transport: str
    bucket_bytes: int
    stages: dict[str, float]
    """stage -> seconds at its limit, for the push's bytes."""
    serial: float
    """Every pass one after the other."""
    overlapped: float
    """The trainer's passes alongside the engine's (a shared move counts on both sides)."""
    limit_seconds: float
    """The transport's own limit (what the `_vs_limit` targets divide by)."""
    push_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "transport": self.transport, "bucket_bytes": self.bucket_bytes,
                "stages": dict(self.stages), "serial": self.serial, "overlapped": self.overlapped,
                "limit_seconds": self.limit_seconds, "push_seconds": self.push_seconds}


def floors(result: BenchResult, views: list[CellView]) -> list[Floor]:
    """The work floor of the fastest full push per scenario and transport, embedded engine."""
    out = []
    for transport, work in WORK.items():
        for scenario in dict.fromkeys(v.result.cell.scenario for v in views if v.result.ok):
            cells = _select(views, scenario=scenario, mode="full", transport=transport, engine="embedded")
            if not cells:
                continue
            best = min(cells, key=lambda v: v.result.seconds)
            limits = result.limits.get((scenario, best.result.cell.bucket_bytes), {})
            if any(name not in limits for _, name, _ in work) or best.limit_seconds is None:
                continue
            stages = {stage: limits[name].seconds * best.result.num_bytes / limits[name].num_bytes
                      for stage, name, _ in work}
            side = {s: sum(stages[st] for st, _, w in work if w in (s, "both")) for s in ("trainer", "engine")}
            out.append(Floor(scenario=scenario, transport=transport, bucket_bytes=best.result.cell.bucket_bytes,
                             stages=stages, serial=sum(stages.values()), overlapped=max(side.values()),
                             limit_seconds=best.limit_seconds, push_seconds=best.result.seconds))
    return out


def _select(views: list[CellView], **match: str) -> list[CellView]:
    return [v for v in views if v.result.ok and all(getattr(v.result.cell, k) == x for k, x in match.items())]


def _fmt_cell(v: CellView) -> str:
    c = v.result.cell
    return f"{c.transport} {c.bucket_bytes >> 20} MiB: {v.result.seconds:.3f} s"


def targets(result: BenchResult, views: list[CellView]) -> list[Target]:
    """The six targets of issue 8, judged on the embedded engine."""
    return [
        _limit_target(views, "broadcast", 0.70, "full sync over broadcast >= 70% of the raw gloo broadcast "
                      "of the same bytes, end to end"),
        _limit_target(views, "shm", 0.50, "shm >= 50% of the preallocated-copy rate"),
        _baseline_target(result, views, "many-small", PER_TENSOR, 5.0,
                         ">= 5x faster than one request per tensor on the many-small (MoE-like) shape"),
        _baseline_target(result, views, "dense", ("checkpoint-reload",), 3.0,
                         ">= 3x faster than checkpoint-then-reload"),
        _lora_target(views),
        _digest_target(views),
    ]


def _limit_target(views: list[CellView], transport: str, threshold: float, goal: str) -> Target:
    cells = [v for v in _select(views, scenario="dense", mode="full", transport=transport, engine="embedded")
             if v.limit_fraction is not None]
    if not cells:
        return Target(name=f"{transport}_vs_limit", goal=goal, threshold=threshold, measured=None)
    best = max(cells, key=lambda v: v.limit_fraction or 0.0)
    detail = (f"best bucket {best.result.cell.bucket_bytes >> 20} MiB: sync {best.result.seconds:.3f} s vs "
              f"{best.limit_name} {best.limit_seconds:.3f} s; all buckets: "
              + ", ".join(f"{v.result.cell.bucket_bytes >> 20} MiB {v.limit_fraction:.0%}" for v in cells))
    return Target(name=f"{transport}_vs_limit", goal=goal, threshold=threshold, measured=best.limit_fraction,
                  detail=detail)


def _baseline_target(result: BenchResult, views: list[CellView], scenario: str, baselines: tuple[str, ...],
                     threshold: float, goal: str) -> Target:
    name = f"{scenario}_vs_{'per_tensor' if baselines == PER_TENSOR else baselines[0].replace('-', '_')}"
    cells = _select(views, scenario=scenario, mode="full", engine="embedded")
    runs = [b for b in result.baselines.get(scenario, []) if b.name in baselines]
    if not cells or not runs:
        return Target(name=name, goal=goal, threshold=threshold, measured=None)
    best = min(cells, key=lambda v: v.result.seconds)
    fastest = min(runs, key=lambda b: b.seconds)
    detail = (f"fastest sync ({_fmt_cell(best)}) vs fastest baseline ({fastest.name}: {fastest.seconds:.3f} s, "
              f"{fastest.num_requests} requests)")
    return Target(name=name, goal=goal, threshold=threshold, measured=fastest.seconds / best.result.seconds,
                  detail=detail)


def _lora_target(views: list[CellView]) -> Target:
    goal = "LoRA adapter sync (r=16, all linear layers) under 5% of the full sync time (same transport)"
    ratios = {}
    for lora in _select(views, scenario="dense", mode="lora", engine="embedded"):
        full = _select(views, scenario="dense", mode="full", engine="embedded", transport=lora.result.cell.transport)
        if full:
            ratios[lora.result.cell.transport] = lora.result.seconds / min(v.result.seconds for v in full)
    if not ratios:
        return Target(name="lora_vs_full", goal=goal, threshold=0.05, measured=None, higher_is_better=False)
    worst = max(ratios, key=lambda t: ratios[t])
    detail = f"worst: {worst}; " + ", ".join(f"{t} {r:.1%}" for t, r in ratios.items())
    return Target(name="lora_vs_full", goal=goal, threshold=0.05, measured=ratios[worst], higher_is_better=False,
                  detail=detail)


def _digest_target(views: list[CellView]) -> Target:
    goal = "digest overhead under 15% of sync time (trainer hash + engine re-hash, full syncs)"
    cells = [v for v in _select(views, scenario="dense", mode="full", engine="embedded") if v.digest_share is not None]
    if not cells:
        return Target(name="digest_share", goal=goal, threshold=0.15, measured=None, higher_is_better=False)
    worst = max(cells, key=lambda v: v.digest_share or 0.0)
    detail = (f"worst: {_fmt_cell(worst)}, of which the engine's re-hash (critical path) "
              f"{worst.engine_rehash_share or 0.0:.1%}; lowest per transport: "
              + ", ".join(f"{t} {min(v.digest_share or 0.0 for v in cells if v.result.cell.transport == t):.1%}"
                          for t in dict.fromkeys(v.result.cell.transport for v in cells)))
    return Target(name="digest_share", goal=goal, threshold=0.15, measured=worst.digest_share,
                  higher_is_better=False, detail=detail)
