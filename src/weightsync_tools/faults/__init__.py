"""Faults and load under weight pushes: what `weightsync bench --suite faults` reports and
tests/faults asserts on.

Each scenario runs a real `weightsync serve` (`rig.py`) and real pushes, injects one fault
(`inject.py`: `FaultyTransport`, child trainers) and records a `FaultOutcome` (`scenarios.py`);
`load.py` drives generate clients under pushes. `run_faults` runs them all and returns the counts.
Importing this package starts nothing. What each outcome records: docs/GUARANTEES.md.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weightsync.transports import TRANSPORTS
from weightsync_tools.faults.inject import (
    CHILD_READY_TIMEOUT_S,
    ChildTrainer,
    FaultyTransport,
    child_main,
    faulty,
    segments_left,
)
from weightsync_tools.faults.load import Answer, AnswerVerifier, LoadFigures, run_load
from weightsync_tools.faults.rig import (
    ADMIN_KEY,
    BUCKET_BYTES,
    MARGIN_S,
    POLICIES,
    PROMPTS,
    SCHEDULING_MARGIN_S,
    DictSource,
    Rig,
    Weights,
    error_bound_s,
    failed_push_bound_s,
    load_weights,
    make_fault_model,
    perturbed,
)
from weightsync_tools.faults.scenarios import (
    LIVE_LEASE_S,
    FaultOutcome,
    bad_bucket,
    disk_full,
    engine_killed,
    engine_stalled,
    engine_stalled_before_push,
    trainer_killed,
    two_trainers,
    unwritable_root,
)

# -- the benchmark -----------------------------------------------------------------------------


def run_faults(*, quick: bool = False, out_dir: Path) -> dict[str, Any]:
    """Inject every fault (per transport) into a real `weightsync serve`, then run the
    load test under every pause policy; returns the figures (also written to
    `out_dir/faults.json`; the model, versions and server scratch live in a temporary
    directory). `quick`: http and disk only, fewer pushes under load."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    transports = ("http", "disk") if quick else TRANSPORTS
    outcomes: list[FaultOutcome] = []
    loads: list[LoadFigures] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="weightsync-faults-") as scratch:
        model_dir = make_fault_model(Path(scratch) / "model")
        with Rig(model_dir, Path(scratch) / "root") as rig:
            for transport in transports:
                outcomes += [bad_bucket(rig, transport, "flip"), bad_bucket(rig, transport, "truncate"),
                             engine_stalled(rig, transport), engine_stalled_before_push(rig, transport),
                             trainer_killed(rig, transport),
                             two_trainers(rig, transport)]
            if not quick:
                outcomes += [trainer_killed(rig, "http", mid_wire=True),
                             trainer_killed(rig, "broadcast", mid_wire=True)]
            outcomes += [disk_full(rig), unwritable_root(rig)]
            outcomes += [engine_killed(rig, transport) for transport in transports]
            loads = [run_load(rig, policy, num_pushes=3 if quick else 6) for policy in POLICIES]
    figures = summarize(outcomes, loads)
    figures["seconds"] = round(time.monotonic() - started, 1)
    (out_dir / "faults.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def summarize(outcomes: Sequence[FaultOutcome], loads: Sequence[LoadFigures]) -> dict[str, Any]:
    return {
        "suite": "faults",
        "faults_injected": len(outcomes),
        "survived": sum(o.survived for o in outcomes),
        "versions_lost": sum(o.versions_went_back + o.lost_acked for o in outcomes),
        "hangs": sum(o.hung for o in outcomes),
        "max_error_seconds": round(max((o.seconds for o in outcomes if o.expects_error), default=0.0), 2),
        "load_requests_failed": sum(f.failed for f in loads),
        "load_requests_lost": sum(f.lost for f in loads),
        "mixed_version_answers": sum(f.spanning for f in loads),
        "torn_answers": sum(f.torn for f in loads),
        "load": {f.policy: f.summary() for f in loads},
        "faults": [o.summary() for o in outcomes],
    }


def format_table(figures: dict[str, Any]) -> str:
    """The figures as two plain-text tables and a summary line."""
    rows = [("fault", "transport", "error", "s", "kept", "next", "ok")]
    for f in figures["faults"]:
        kept = "-" if f["kept_last_good"] is None else ("yes" if f["kept_last_good"] else "NO")
        error = f"{f['error'] or '-'}{'/' + str(f['status']) if f['status'] else ''}"
        rows.append((f["fault"], f["transport"], error, f"{f['seconds']:.1f}", kept,
                     "yes" if f["next_push"] else "NO", "ok" if f["survived"] else "FAILED"))
    lines = _table(rows)
    lines.append("")
    load_rows = [("policy", "held", "sent", "completed", "aborted", "failed", "lost", "spanning", "torn")]
    for f in figures["load"].values():
        load_rows.append((f["policy"], *(str(f[k]) for k in ("held", "sent", "completed", "aborted", "failed",
                                                             "lost", "spanning", "torn"))))
    lines += _table(load_rows)
    lines.append("")
    lines.append(f"faults injected {figures['faults_injected']}, survived {figures['survived']}, "
                 f"versions lost {figures['versions_lost']}, hangs {figures['hangs']}, "
                 f"load requests failed {figures['load_requests_failed']}, lost {figures['load_requests_lost']}, "
                 f"torn answers {figures['torn_answers']}")
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


__all__ = [
    "ADMIN_KEY",
    "BUCKET_BYTES",
    "CHILD_READY_TIMEOUT_S",
    "LIVE_LEASE_S",
    "MARGIN_S",
    "POLICIES",
    "PROMPTS",
    "SCHEDULING_MARGIN_S",
    "TRANSPORTS",
    "Answer",
    "AnswerVerifier",
    "ChildTrainer",
    "DictSource",
    "FaultOutcome",
    "FaultyTransport",
    "LoadFigures",
    "Rig",
    "Weights",
    "bad_bucket",
    "child_main",
    "disk_full",
    "engine_killed",
    "engine_stalled",
    "engine_stalled_before_push",
    "error_bound_s",
    "failed_push_bound_s",
    "faulty",
    "format_table",
    "load_weights",
    "make_fault_model",
    "perturbed",
    "run_faults",
    "run_load",
    "segments_left",
    "summarize",
    "trainer_killed",
    "two_trainers",
    "unwritable_root",
]
