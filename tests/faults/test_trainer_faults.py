"""Faults on the trainer side, against a real `weightsync serve`: the trainer
process killed mid-stream (between buckets, and with a bucket half on the wire),
the disk transport's disk filling up or its directory becoming unwritable, two
trainers pushing at once, and older versions pushed after newer ones.

Killed trainers run in child processes (`python -m weightsync_tools.faults child`)
and are SIGKILLed once they report, deterministically, that the fault point is
reached; the engine must keep serving bit-identically and must not be wedged by
the half-open session: a new trainer, built as the README builds it, pushes at
once and takes the dead trainer's session over (its process is gone) without a
single 409 reaching it, well within the dead push's timeout_s.
"""

from __future__ import annotations

import pytest

import weightsync as ws
from fault_helpers import assert_survived
from weightsync_tools import faults
from weightsync_tools.faults import Rig

# fixtures rig, fault_model: tests/support/fault_fixtures.py
pytestmark = pytest.mark.faults


@pytest.mark.parametrize("transport", faults.TRANSPORTS)
def test_trainer_killed_between_buckets(rig: Rig, transport: str) -> None:
    out = faults.trainer_killed(rig, transport)
    assert_survived(out)
    # Buckets 0 and 1 were out when the trainer died (staged by the engine; disk: written).
    assert out.staged_before_kill == 2
    if transport == "disk":  # its temp dir was left, and the next push removed it
        assert any("the next push removes them" in note for note in out.notes), out.notes
    if transport == "shm":  # its segment was left, and the next push removed it, unless any other process
        # on this host (the suite's other session) made a segment first, which sweeps a dead creator's
        assert any("the next push removes them" in note or "an orphan sweep" in note for note in out.notes), out.notes
    assert not out.leftovers
    assert_taken_over(out, rig)


def assert_taken_over(out: faults.FaultOutcome, rig: Rig) -> None:
    """The new trainer's push met no 409, not even inside WeightSync: the engine had already
    dropped the session (a cut HTTP body, a broken group) or saw the owner's process gone."""
    assert out.conflicts_before_next == 0
    assert not any("busy answer" in n for n in out.next_push_notes), out.next_push_notes
    if out.transport in ("shm", "disk") or "between" in out.fault:
        assert any("its process is gone" in n for n in out.next_push_notes), out.next_push_notes
    print(f"\nafter a killed trainer over {out.transport}: next push in {out.next_push_seconds:.2f}s "
          f"(dead push's timeout_s {rig.timeout_s}s): {out.next_push_notes}")


@pytest.mark.parametrize("transport", ["http", "broadcast"])
def test_trainer_killed_with_a_bucket_half_on_the_wire(rig: Rig, transport: str) -> None:
    # http: half of bucket 2's request body was sent; broadcast: the engine's receive
    # of bucket 2 is posted and the broadcast never comes.
    out = faults.trainer_killed(rig, transport, mid_wire=True)
    assert_survived(out)
    assert out.staged_before_kill == 2
    assert_taken_over(out, rig)


def test_disk_full_mid_version(rig: Rig) -> None:
    out = faults.disk_full(rig)
    assert_survived(out, errors=("DiskTransportError",), needles=("File too large",))
    assert "writing bucket" in out.error and "bucket 0 " not in out.error, "it failed mid-version"
    assert ".tmp-v" in out.error  # names the directory it was writing


def test_unwritable_disk_root(rig: Rig) -> None:
    out = faults.unwritable_root(rig)
    assert_survived(out, errors=("DiskTransportError",), needles=("unwritable",))


def test_disk_root_under_a_file_is_refused_up_front(rig: Rig) -> None:
    blocker = rig.root / "a-file"
    blocker.write_text("x")
    with pytest.raises(NotADirectoryError, match="a-file"):
        ws.WeightSync([rig.engine()], transport="disk", disk_root=str(blocker / "versions"))


@pytest.mark.parametrize("transport", faults.TRANSPORTS)
def test_two_trainers_one_wins_and_versions_never_go_backwards(rig: Rig, transport: str) -> None:
    out = faults.two_trainers(rig, transport)
    # B collides with live A's open session: a clear 409 naming A, never a mix (A's weights
    # are served bit-identically); B's older and equal versions are refused with 409; in
    # free races the newest successful push is served exactly; versions seen never decrease.
    assert_survived(out, errors=("EngineError",), needles=("is held by trainer",), status=409)
    watched = out.watched_versions  # read before A's push, polled, and read after the last push
    assert watched == sorted(watched) and watched[0] < watched[-1], watched
