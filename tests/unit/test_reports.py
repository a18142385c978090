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
    """`Stages` (added to while a push runs) has exactly the stages of `StageSeconds` (the report's),
    which declares them: each one read and written, any other name refused, naming the stages."""
    stages = Stages(gather=1.0, diff=2.0)
    for f in fields(StageSeconds):
        setattr(stages, f.name, getattr(stages, f.name) * 2)
    stages.wire += 0.5
    assert stages.frozen() == StageSeconds(gather=2.0, wire=0.5, diff=4.0)
    with pytest.raises(AttributeError, match="no stage 'wires' .the stages: gather, pack, hash, wire, load, diff"):
        stages.wires += 1.0
    with pytest.raises(TypeError, match="wires"):
        Stages(wires=1.0)


def test_an_acks_memory_figures_round_trip_and_are_none_where_absent() -> None:
    """`peak_extra_bytes` and `kept_bytes` travel in the wire ack and in the report; an ack
    without them (an older engine, a stock SGLang) reads as None, never as 0."""
    ack = Ack(engine="http://e", version=2, digests=("aa",), loaded_names=frozenset({"x"}),
              peak_extra_bytes=5 << 20, kept_bytes=-4096)
    wire = ack.to_wire()
    assert wire["peak_extra_bytes"] == 5 << 20 and wire["kept_bytes"] == -4096
    assert Ack.from_dict(json.loads(json.dumps(wire)), engine="http://e") == ack
    report = SyncReport(version=2, mode="full", transport="shm", num_bytes=1, num_tensors=1, num_buckets=1,
                        seconds=1.0, acks=(ack,))
    assert report.to_dict()["acks"][0]["peak_extra_bytes"] == 5 << 20
    assert SyncReport.from_dict(json.loads(json.dumps(report.to_dict()))).acks == (ack,)
    older = Ack.from_dict({"version": 2, "digests": ["aa"], "loaded_names": ["x"]}, engine="http://e")
    assert older.peak_extra_bytes is None and older.kept_bytes is None
    assert older == ack.without_memory() and "kept_bytes" not in older.to_wire()


def test_the_workers_of_one_engine_sum_their_memory() -> None:
    """vLLM's tensor-parallel workers are separate processes: an engine's figures are their
    sum, and unknown where any worker's is."""
    one = Ack(engine="vllm", version=3, peak_extra_bytes=100, kept_bytes=10)
    two = Ack(engine="vllm", version=3, peak_extra_bytes=200, kept_bytes=-5)
    assert Ack.summed([one, two]) == Ack(engine="vllm", version=3, peak_extra_bytes=300, kept_bytes=5)
    assert Ack.summed([one, two.without_memory()]) == one.without_memory()
