"""Engine memory during a push (`weightsync bench --suite engine-memory`): what each engine
holds beyond the model while a full update arrives and after it committed, in bytes and in
model copies.

For every engine ("embedded": `weightsync serve`; "vllm-tp1", "vllm-tp2": `vllm serve` with
weightsync's worker extension, when vLLM is installed), transport and commit it takes
(`COMMITS`: "staged", and "streamed" where the engine streams), a fresh engine gets two
full pushes of the same dense float32 model; the second one is measured two ways:
- the engine's own word, from its ack (`Ack.peak_extra_bytes`, `Ack.kept_bytes`: the resident
  set of the process(es) that received the update, summed over vLLM's workers, from the
  session's begin to its commit);
- the users' side, as a cross-check: the Pss (each shared page divided among the processes
  that map it) of every process of the engine (its server and all descendants), summed and
  sampled every `SAMPLE_S` seconds from just before the push until it returned; peak and
  kept are above the level just before the push.
Measures memory, never time. Sizes in bytes; figures relative to the model's bytes.
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from weightsync.errors import WeightSyncError
from weightsync.process_memory import pss_bytes
from weightsync_tools.bench import Progress

ENGINES = ("embedded", "vllm-tp1", "vllm-tp2")
DEFAULT_TRANSPORTS = {"embedded": ("shm", "http"), "vllm-tp1": ("shm",), "vllm-tp2": ("shm",)}
"""What each engine is measured over unless asked otherwise (the issue's cells)."""
COMMITS = {engine: ("staged", "streamed") for engine in ENGINES}
"""The commits each engine takes (`WeightSync(commit=...)`): all of them, both (`vllm serve` streams)."""
DEFAULT_MODEL_BYTES = 204 << 20
DEFAULT_BUCKET_BYTES = 32 << 20
SAMPLE_S = 0.02
"""Seconds between two Pss samples of the engine's processes."""


@dataclass(frozen=True, kw_only=True)
class EngineMemory:
    """One engine's memory during the second of two full pushes over one transport."""

    engine: str
    """One of ENGINES."""
    transport: str
    commit: str = "staged"
    """`WeightSync(commit=...)`: "staged" or "streamed"."""
    model_bytes: int
    """Bytes of the weights pushed (float32)."""
    bucket_bytes: int
    ack_peak_extra_bytes: int | None = None
    """The ack's peak beyond begin (None: the engine did not measure it)."""
    ack_kept_bytes: int | None = None
    """The ack's bytes kept after the commit beyond begin."""
    num_processes: int = 0
    """Processes of the engine whose Pss was summed."""
    pss_before_bytes: int | None = None
    """Their Pss just before the push."""
    pss_peak_extra_bytes: int | None = None
    """Their largest sampled Pss during the push, minus `pss_before_bytes`."""
    pss_kept_bytes: int | None = None
    """Their Pss once the push returned, minus `pss_before_bytes`."""
    error: str | None = None
    """Why this cell has no figures."""

    def copies(self, value: int | None) -> float | None:
        """`value` in model copies."""
        return None if value is None else value / self.model_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def engine_processes(root_pid: int) -> list[int]:
    """`root_pid` and every process descended from it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return sorted(found)


def total_pss(pids: list[int]) -> int | None:
    """The summed Pss of `pids` (None where none could be read; a process gone counts 0)."""
    values = [pss_bytes(pid) for pid in pids]
    return None if all(v is None for v in values) else sum(v or 0 for v in values)


class PssSampler:
    """The largest summed Pss of some processes, sampled on a thread every `SAMPLE_S` seconds."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)

    def __enter__(self) -> PssSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def _sample(self) -> None:
        value = total_pss(self.pids)
        if value is not None:
            self.peak = value if self.peak is None else max(self.peak, value)


def measure_engine(kind: str, transport: str, *, model: Any, model_dir: Path, model_bytes: int,
                   bucket_bytes: int, root: Path, commit: str = "staged") -> EngineMemory:
    """Start engine `kind` on `model_dir`, push `model` to it twice over `transport`, and measure
    the second push (see the module docstring). An engine that fails gives a cell with `error`."""
    import weightsync as ws
    from weightsync_tools.bench.engines import start_engine

    cell = EngineMemory(engine=kind, transport=transport, commit=commit, model_bytes=model_bytes,
                        bucket_bytes=bucket_bytes)
    engine_kind, tp = ("embedded", 1) if kind == "embedded" else ("vllm", int(kind.removeprefix("vllm-tp")))
    try:
        with start_engine(engine_kind, model_dir, disk_root=root, timeout_s=300.0,
                          tensor_parallel_size=tp) as engine, \
                ws.WeightSync([engine.client], transport=transport, bucket_bytes=bucket_bytes, commit=commit,
                              disk_root=str(root / "versions")) as sync:
            sync.push(model, version=engine.next_version())
            pids = engine_processes(engine.pid)
            before = total_pss(pids)
            with PssSampler(pids) as sampler:
                report = sync.push(model, version=engine.next_version())
            after = total_pss(pids)
    except (WeightSyncError, RuntimeError, OSError) as e:  # recorded in the cell; the suite goes on
        return replace(cell, error=f"{type(e).__name__}: {e}"[:500])
    if not report.verified:
        return replace(cell, error=f"the push was not verified: {'; '.join(report.notes)}"[:500])
    (ack,) = report.acks
    peak = sampler.peak
    return replace(
        cell, ack_peak_extra_bytes=ack.peak_extra_bytes, ack_kept_bytes=ack.kept_bytes, num_processes=len(pids),
        pss_before_bytes=before,
        pss_peak_extra_bytes=None if before is None or peak is None else max(0, peak - before),
        pss_kept_bytes=None if before is None or after is None else after - before)


@dataclass
class EngineMemoryResult:
    """Every cell of one run, with the model and the machine."""

    scenario: dict[str, Any]
    machine: dict[str, Any]
    cells: list[EngineMemory] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"suite": "engine-memory", "scenario": self.scenario, "machine": self.machine,
                "cells": [c.to_dict() for c in self.cells], "notes": self.notes}


def run_engine_memory_suite(*, root: Path, model_bytes: int = DEFAULT_MODEL_BYTES,
                            bucket_bytes: int = DEFAULT_BUCKET_BYTES, engines: tuple[str, ...] | None = None,
                            transports: tuple[str, ...] | None = None,
                            progress: Progress = lambda _: None) -> EngineMemoryResult:
    """Measure every engine (default: "embedded", and both vLLM ones when vLLM is installed)
    over its transports (`DEFAULT_TRANSPORTS`, or those of `transports` it has)."""
    from weightsync_tools.bench.engines import vllm_available
    from weightsync_tools.bench.scenarios import engine_model_dir, make_scenario, trainer_model
    from weightsync_tools.bench.suite import describe_machine

    if engines is None:
        engines = ENGINES if vllm_available() else ("embedded",)
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    scenario = make_scenario("dense", model_bytes)
    result = EngineMemoryResult(scenario=scenario.to_dict(), machine=describe_machine())
    progress(f"engine memory: {scenario.describe()}, {bucket_bytes >> 20} MiB buckets")
    model_dir = engine_model_dir(scenario, root / "models")
    model = trainer_model(scenario)
    for kind in engines:
        for transport in transports or DEFAULT_TRANSPORTS[kind]:
            for commit in COMMITS[kind]:
                progress(f"{kind} over {transport}, {commit}: two full pushes, the second measured")
                cell = measure_engine(kind, transport, model=model, model_dir=model_dir, commit=commit,
                                      model_bytes=scenario.num_bytes, bucket_bytes=bucket_bytes, root=root)
                result.cells.append(cell)
                if cell.error:
                    result.notes.append(f"{kind}/{transport}/{commit}: {cell.error}")
    return result


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def _copies(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def format_table(result: EngineMemoryResult) -> str:
    """One row per engine and transport: peak and kept beyond the level at begin (ack) and before
    the push (Pss), in model copies and MiB."""
    scenario = result.scenario
    lines = [f"engine memory, second of two full pushes: {scenario['num_bytes'] / 2**20:.0f} MiB float32 model "
             f"({scenario['num_tensors']} tensors), "
             f"{result.cells[0].bucket_bytes >> 20 if result.cells else 0} MiB buckets; "
             "model copies (MiB) beyond the level at begin (ack) or before the push (Pss)",
             f"{'engine':<10} {'transport':<9} {'commit':<8} {'ack peak':>16} {'ack kept':>16} {'Pss peak':>16}"
             f" {'Pss kept':>16} {'procs':>5}"]
    for c in result.cells:
        if c.error:
            lines.append(f"{c.engine:<10} {c.transport:<9} {c.commit:<8} FAILED: {c.error}")
            continue
        figures = [f"{_copies(c.copies(v))} ({_mib(v)})" for v in
                   (c.ack_peak_extra_bytes, c.ack_kept_bytes, c.pss_peak_extra_bytes, c.pss_kept_bytes)]
        lines.append(f"{c.engine:<10} {c.transport:<9} {c.commit:<8} " + " ".join(f"{f:>16}" for f in figures)
                     + f" {c.num_processes:>5}")
    m = result.machine
    lines.append(f"machine: {m.get('cpu_model')}, {m.get('cpu_count')} cores, "
                 f"{m.get('memory_bytes', 0) / 2**30:.0f} GiB, torch {m.get('torch')}")
    return "\n".join(lines + [f"note: {n}" for n in result.notes])


__all__ = ["COMMITS", "DEFAULT_BUCKET_BYTES", "DEFAULT_MODEL_BYTES", "ENGINES", "EngineMemory", "EngineMemoryResult",
           "engine_processes", "format_table", "measure_engine", "run_engine_memory_suite"]
