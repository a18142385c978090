"""What comes back from an update (`weightsync.reports`): acks and reports, through JSON as
the other trainer ranks receive them."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from weightsync.reports import Ack, Stages, StageSeconds, SyncReport


def test_report_round_trip() -> None:
    ack = Ack(engine="http://e", version=2, digests=("aa", None), loaded_names=frozenset({"x"}))
    report = SyncReport(
        version=2, mode="full", transport="http", num_bytes=2_000_000_000, num_tensors=3, num_buckets=2,
        seconds=2.0, stages=StageSeconds(wire=1.5), verified=True, acks=(ack,),
    )
    assert report.gbps == pytest.approx(1.0)
    again = SyncReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again == report
    assert "phases" not in report.to_dict(), "a push of one phase writes what it wrote before phases existed"


def test_a_report_with_a_first_phase_round_trips_with_it() -> None:
    """A "lora" push that re-synced the base weights first: the base push is its first phase,
    with its own bytes and stages, and the other trainer ranks get the same report."""
    base = SyncReport(version=4, mode="full", transport="http", num_bytes=1_000, num_tensors=10, num_buckets=1,
                      seconds=0.5, stages=StageSeconds(wire=0.25, pack=0.125), verified=True)
    report = SyncReport(version=4, mode="lora", transport="http", num_bytes=40, num_tensors=4, num_buckets=1,
                        seconds=0.75, verified=True, phases=(base,))
    again = SyncReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again == report and again.phases[0].num_bytes == 1_000 and again.phases[0].stages.pack == 0.125


def test_the_running_stages_are_the_reported_ones() -> None:
    """`Stages` (added to while a push runs) and `StageSeconds` (the report's) name the same stages."""
    assert [f.name for f in fields(Stages)] == [f.name for f in fields(StageSeconds)]
    stages = Stages(gather=1.0, diff=2.0)
    stages.wire += 0.5
    assert stages.frozen() == StageSeconds(gather=1.0, wire=0.5, diff=2.0)
