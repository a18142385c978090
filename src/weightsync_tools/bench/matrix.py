"""The sync matrix: mode x transport x engine x bucket size, each cell a few
`WeightSync.push` calls of the same model into a running engine.

A cell opens a fresh `WeightSync`, pushes once to warm up (forms the
broadcast group, maps shared memory, syncs the base weights before the
first adapter), then pushes `repeats` more times and keeps every report.
The cell's figure is its fastest push; per-stage seconds (gather, pack,
hash, wire, load) come from that push's `SyncReport`; the HTTP requests of
each push are counted by the engine client (`num_requests`). A cell that
fails is kept with its error and the matrix goes on.

Boundaries: runs pushes and records reports; starting engines is
`bench.engines`, models are `bench.scenarios`, judging is `bench.report`.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync.errors import WeightSyncError
from weightsync.manifest import MODES as ALL_MODES
from weightsync_tools.bench.engines import RunningEngine

log = logging.getLogger(__name__)

MODES = tuple(m for m in ALL_MODES if m not in ("delta", "sparse"))
"""Every mode but "delta" and "sparse": a cell pushes the same weights again and again,
so they would move nothing (the "sparse" suite measures sparse on real RL steps)."""
STAGES = ("gather", "pack", "hash", "wire", "load")


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One point of the matrix."""

    scenario: str
    mode: str
    transport: str
    engine: str
    bucket_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "mode": self.mode, "transport": self.transport,
                "engine": self.engine, "bucket_bytes": self.bucket_bytes}


@dataclass(frozen=True, kw_only=True)
class CellResult:
    """What the pushes of one cell measured."""

    cell: Cell
    num_bytes: int = 0
    """Bytes one push moves."""
    num_tensors: int = 0
    num_buckets: int = 0
    runs: tuple[float, ...] = ()
    """Seconds of every measured push."""
    stages: dict[str, float] = field(default_factory=dict)
    """Per-stage seconds of the fastest push."""
    verified: bool = False
    """Every measured push was acked with matching digests and names."""
    requests: tuple[int, ...] = ()
    """HTTP requests (round trips to the engine) of every measured push. A LoRA push's
    unload of the adapter it retires runs in the background, in this push or the next."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.runs)

    @property
    def seconds(self) -> float:
        return min(self.runs) if self.runs else float("nan")

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.runs) if self.runs else float("nan")

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.ok and self.seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**self.cell.to_dict(), "num_bytes": self.num_bytes, "num_tensors": self.num_tensors,
                "num_buckets": self.num_buckets, "seconds": self.seconds if self.ok else None,
                "median_seconds": self.median_seconds if self.ok else None,
                "gbps": self.gbps if self.ok else None, "runs": list(self.runs),
                "stages": dict(self.stages), "verified": self.verified, "requests": list(self.requests),
                "error": self.error}


def run_cell(cell: Cell, engine: RunningEngine, model: Any, *, repeats: int, versions_dir: Path,
             timeout_s: float = 120.0) -> CellResult:
    """Warm-up push plus `repeats` measured pushes of `model` for `cell`."""
    import weightsync as ws

    reports, requests = [], []
    try:
        with ws.WeightSync([engine.client], transport=cell.transport, mode=cell.mode,
                           bucket_bytes=cell.bucket_bytes, timeout_s=timeout_s, disk_root=str(versions_dir),
                           keep_versions=1) as sync:
            sync.push(model, version=engine.next_version())
            for _ in range(max(1, repeats)):
                before = engine.client.num_requests
                reports.append(sync.push(model, version=engine.next_version()))
                requests.append(engine.client.num_requests - before)
    except (WeightSyncError, OSError, RuntimeError, ValueError) as e:  # reported; the matrix goes on
        log.warning("cell %s failed: %s", cell, e, exc_info=log.isEnabledFor(logging.DEBUG))
        return CellResult(cell=cell, error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
    best = min(reports, key=lambda r: r.seconds)
    return CellResult(
        cell=cell, num_bytes=best.num_bytes, num_tensors=best.num_tensors, num_buckets=best.num_buckets,
        runs=tuple(r.seconds for r in reports), stages=best.stages.to_dict(),
        verified=all(r.verified for r in reports), requests=tuple(requests),
    )


def engine_cells(scenario: str, engine: RunningEngine, *, modes: Sequence[str], transports: Sequence[str],
                 bucket_sizes: Sequence[int]) -> list[Cell]:
    """The cells one engine runs for one scenario: every mode and transport it supports;
    "lora" only at the first bucket size (an adapter is a few MB)."""
    cells: list[Cell] = []
    for mode in modes:
        supported = engine.client.lora_transports if mode == "lora" else engine.client.transports
        for transport in transports:
            if transport not in supported:
                continue
            sizes = bucket_sizes[:1] if mode == "lora" else bucket_sizes
            cells.extend(Cell(scenario=scenario, mode=mode, transport=transport, engine=engine.kind,
                              bucket_bytes=size) for size in sizes)
    return cells


def run_engine_cells(cells: Sequence[Cell], engine: RunningEngine, models: dict[str, Any], *, repeats: int,
                     versions_dir: Path, on_cell: Callable[[CellResult], None] | None = None,
                     ) -> list[CellResult]:
    """Run `cells` in order on `engine`; `models` maps a mode to the trainer model it pushes."""
    results = []
    for cell in cells:
        result = run_cell(cell, engine, models[cell.mode], repeats=repeats, versions_dir=versions_dir)
        results.append(result)
        if on_cell is not None:
            on_cell(result)
    return results
