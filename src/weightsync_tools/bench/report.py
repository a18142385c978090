"""The bench's output: a text table, a PNG chart and one JSON document.

`format_report` lays out, in order: the machine, the matrix (one row per
cell with per-stage seconds, fraction of its limit and speed-up over each
baseline), the limits, the baselines, the fixed cost of a push (seconds and
HTTP requests of a push that moves almost nothing), the trainer's peak
memory, the targets (met / NOT MET / not measured) and any notes. `to_json` carries the
same figures for machines; `write_chart` draws them.

Boundaries: formatting only; the figures come from `bench.analysis` and the
suite's `BenchResult`. The CLI decides where text goes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from weightsync_tools.bench.analysis import CellView, Floor, Target, cell_views, floors, targets
from weightsync_tools.bench.fixed_cost import describe as describe_fixed_cost
from weightsync_tools.bench.matrix import STAGES, CellResult
from weightsync_tools.bench.scenarios import MANY_SMALL_NOTE
from weightsync_tools.bench.suite import BenchResult

MiB = 1 << 20
BASELINE_ABBREV = {"per-tensor-broadcast": "xPTB", "per-tensor-http": "xPTH", "checkpoint-reload": "xCKPT"}


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def machine_line(result: BenchResult) -> str:
    m = result.machine
    load = "/".join(f"{x:.1f}" for x in m.get("load_average_start", []))
    load_end = "/".join(f"{x:.1f}" for x in m.get("load_average_end", []))
    return (f"machine: {m.get('cpu_count')} CPUs ({m.get('cpu_model') or 'unknown CPU'}), "
            f"{m.get('memory_bytes', 0) / 2**30:.0f} GiB, torch {m.get('torch')} ({m.get('torch_threads')} threads), "
            f"Python {m.get('python')}, {m.get('platform')}; load average {load} at start, {load_end} at end")


def matrix_table(views: list[CellView]) -> str:
    baselines = list(dict.fromkeys(name for v in views for name in v.speedups))
    header = ["scenario", "mode", "transport", "engine", "bucket", "MiB", "s", "GB/s", *STAGES, "limit", "of limit",
              *(BASELINE_ABBREV.get(b, b) for b in baselines), "verified"]
    rows = []
    for v in views:
        r, c = v.result, v.result.cell
        head = [c.scenario, c.mode, c.transport, c.engine, f"{c.bucket_bytes >> 20}M"]
        if not r.ok:
            rows.append([*head, "-", "-", "-", *("-" for _ in STAGES), "-", "-", *("-" for _ in baselines),
                         f"FAILED: {r.error}"[:60]])
            continue
        rows.append([*head, f"{r.num_bytes / MiB:.0f}", _num(r.seconds), _num(r.gbps, ".2f"),
                     *(_num(r.stages.get(s)) for s in STAGES), v.limit_name or "-", _num(v.limit_fraction, ".0%"),
                     *(_num(v.speedups.get(b), ".1f") for b in baselines), "yes" if r.verified else "no"])
    legend = ("s: fastest push; stages: seconds of that push (pack/hash overlap wire: they do not add up); "
              "of limit: limit s / sync s for the same bytes; "
              + ", ".join(f"{a}: x faster than {b}" for b, a in BASELINE_ABBREV.items() if b in baselines))
    return _table(header, rows) + "\n" + legend


def limits_table(result: BenchResult) -> str:
    names = list(dict.fromkeys(n for lim in result.limits.values() for n in lim))
    rows = []
    for (scenario, size), lim in result.limits.items():
        some = next(iter(lim.values()))
        rows.append([scenario, f"{size >> 20}M", f"{some.num_bytes / MiB:.0f}",
                     *(f"{lim[n].gbps:.2f} ({lim[n].seconds:.3f}s)" if n in lim else "-" for n in names)])
    return _table(["scenario", "chunk", "MiB", *(f"{n} GB/s (s)" for n in names)], rows)


def baselines_table(result: BenchResult) -> str:
    rows = []
    for scenario, runs in result.baselines.items():
        for b in runs:
            parts = ", ".join(f"{k} {v:.3f}s" for k, v in b.parts.items())
            rows.append([scenario, b.name, str(b.num_requests), f"{b.num_bytes / MiB:.0f}", _num(b.seconds),
                         _num(b.gbps, ".2f"), parts or "-"])
    return _table(["scenario", "baseline", "requests", "MiB", "s", "GB/s", "parts"], rows)


def _requests(counts: tuple[int, ...]) -> str:
    """HTTP requests per push: "5", or "5-6" when the pushes differ."""
    if not counts:
        return "-"
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}-{high}"


def fixed_cost_table(cells: list[CellResult]) -> str:
    rows = []
    for r in cells:
        c = r.cell
        if not r.ok:
            rows.append([c.engine, c.mode, c.transport, "-", "-", "-", "-", "-", f"FAILED: {r.error}"[:60]])
            continue
        rows.append([c.engine, c.mode, c.transport, f"{r.num_bytes / 1024:.1f}", str(r.num_tensors),
                     _num(r.seconds * 1e3, ".1f"), _num(r.median_seconds * 1e3, ".1f"), _requests(r.requests),
                     "yes" if r.verified else "no"])
    return (_table(["engine", "mode", "transport", "KiB", "tensors", "ms", "median ms", "HTTP requests",
                    "verified"], rows)
            + "\nms: fastest push; HTTP requests: round trips to the engine per push (a LoRA push's unload "
              "of the adapter it retires runs in the background and lands in this push or the next)")


def memory_table(result: BenchResult) -> str:
    rows = [[m.method, f"{m.model_bytes / MiB:.0f}", f"{m.peak_extra_bytes / MiB:.1f}",
             f"{m.peak_extra_bytes / max(1, m.model_bytes):.0%}", f"{m.largest_tensor_bytes / MiB:.1f}"]
            for m in result.memory]
    return _table(["merged LoRA", "model MiB", "peak extra MiB", "of model", "largest tensor MiB"], rows)


def floors_table(found: list[Floor]) -> str:
    rows = [[f.scenario, f.transport, f"{f.bucket_bytes >> 20}M",
             ", ".join(f"{stage} {sec * 1e3:.1f}" for stage, sec in f.stages.items()),
             f"{f.serial * 1e3:.1f}", f"{f.overlapped * 1e3:.1f}", f"{f.push_seconds * 1e3:.1f}",
             f"{f.limit_seconds / f.overlapped:.0%}"]
            for f in found]
    return _table(["scenario", "transport", "bucket", "passes at this run's limits (ms)", "serial ms",
                   "overlapped ms", "push ms", "best of limit"], rows)


def targets_table(found: list[Target]) -> str:
    rows = []
    for t in found:
        shown = "-"
        if t.measured is not None:
            shown = f"{t.measured:.1f}x" if t.threshold >= 1 else f"{t.measured:.1%}"
        wanted = (f">= {t.threshold:g}x" if t.threshold >= 1 else
                  (f">= {t.threshold:.0%}" if t.higher_is_better else f"< {t.threshold:.0%}"))
        rows.append([t.verdict, t.name, wanted, shown, t.detail])
    return "\n".join(f"{r[0]:>12}  {r[1]:<26} {r[2]:>7}  measured {r[3]:>7}  {r[4]}" for r in rows)


def format_report(result: BenchResult) -> str:
    views = cell_views(result)
    found = targets(result, views)
    sections = [
        machine_line(result),
        "scenarios:\n" + "\n".join(f"  {s.describe()}" for s in result.scenarios)
        + ("\n  (" + MANY_SMALL_NOTE + ")" if any(s.name == "many-small" for s in result.scenarios) else ""),
        "sync matrix:\n" + matrix_table(views),
        "machine limits (same bytes, same chunks):\n" + limits_table(result),
        "baselines (embedded engine):\n" + baselines_table(result),
    ]
    if result.fixed_cost:
        sections.append(f"fixed cost of a push ({describe_fixed_cost()}):\n" + fixed_cost_table(result.fixed_cost))
    if result.memory:
        sections.append("trainer peak memory beyond the model:\n" + memory_table(result))
    work = floors(result, views)
    if work:
        sections.append("work floor of a verified full push (each pass over the bytes at its limit measured above; "
                        "overlapped: trainer passes alongside engine passes; best of limit: limit / overlapped, "
                        "the most a perfect pipeline could reach):\n" + floors_table(work))
    sections.append("targets (reported, never asserted; judged on the embedded engine):\n" + targets_table(found))
    notes = list(result.notes)
    if result.config.quick:
        notes.append("--quick run: small model, one bucket size; figures are indicative only")
    if notes:
        sections.append("notes:\n" + "\n".join(f"  - {n}" for n in notes))
    sections.append(f"bench took {result.seconds:.0f} s")
    return "\n\n".join(sections)


def to_json(result: BenchResult) -> dict[str, Any]:
    views = cell_views(result)
    return {
        "bench": "weightsync", "suite": "sync", "machine": result.machine, "config": result.config.to_dict(),
        "scenarios": [s.to_dict() for s in result.scenarios],
        "limits": [{"scenario": sc, **lim.to_dict()} for (sc, _), lims in result.limits.items()
                   for lim in lims.values()],
        "cells": [v.to_dict() for v in views],
        "fixed_cost": [c.to_dict() for c in result.fixed_cost],
        "baselines": [{"scenario": sc, **b.to_dict()} for sc, runs in result.baselines.items() for b in runs],
        "memory": [m.to_dict() for m in result.memory],
        "targets": [t.to_dict() for t in targets(result, views)],
        "floors": [f.to_dict() for f in floors(result, views)],
        "engine_start_seconds": result.engine_start_seconds, "notes": list(result.notes),
        "seconds": result.seconds,
    }


def write_chart(result: BenchResult, path: Path) -> Path:
    """Left: GB/s of each full sync next to its limit; right: seconds of the fastest
    full sync per transport against each baseline (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    views = [v for v in cell_views(result) if v.result.ok and v.result.cell.mode == "full"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.5))
    labels = [f"{v.result.cell.scenario} {v.result.cell.transport} {v.result.cell.engine} "
              f"{v.result.cell.bucket_bytes >> 20}M" for v in views]
    xs = range(len(views))
    left.bar([x - 0.2 for x in xs], [v.result.gbps for v in views], width=0.4, label="sync")
    left.bar([x + 0.2 for x in xs], [v.result.num_bytes / v.limit_seconds / 1e9 if v.limit_seconds else 0
                                     for v in views], width=0.4, label="its limit")
    left.set_xticks(list(xs), labels, rotation=70, fontsize=7, ha="right", rotation_mode="anchor")
    left.set_ylabel("GB/s")
    left.set_title("full sync vs the machine's limit (same bytes)")
    left.legend()
    _baseline_panel(right, result, views)
    fig.suptitle(machine_line(result).replace("; load", "\nload", 1), fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _baseline_panel(ax: Any, result: BenchResult, views: list[CellView]) -> None:
    names, seconds, colors = [], [], []
    for scenario in [s.name for s in result.scenarios]:
        mine = [v for v in views if v.result.cell.scenario == scenario and v.result.cell.engine == "embedded"]
        for transport in dict.fromkeys(v.result.cell.transport for v in mine):
            best = min(v.result.seconds for v in mine if v.result.cell.transport == transport)
            names.append(f"{scenario} {transport}")
            seconds.append(best)
            colors.append("tab:blue")
        for b in result.baselines.get(scenario, []):
            names.append(f"{scenario} {b.name}")
            seconds.append(b.seconds)
            colors.append("tab:red")
    ax.barh(range(len(names)), seconds, color=colors)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("seconds (log); blue: weightsync, red: baselines")
    ax.set_title("one full sync vs how it is done today")
