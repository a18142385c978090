"""Faults on the engine side or on the wire, for every transport, against a real
`weightsync serve`: a corrupted bucket, a truncated bucket, an engine that stalls
past timeout_s, an engine killed mid-stream and restarted.

Each test injects one fault into the second push of a trainer that has just
pushed successfully (a stall: also before a trainer's first push), and proves
(`assert_survived`): the trainer gets a clear error within its bound (a stall:
within the README's `timeout_s + min(timeout_s, 10 s)`), the engine serves its
last good version bit-identically (digests) and generates with it, no incomplete
version directory is visible, the trainer's NEXT push through the same
`WeightSync` succeeds and the engine then serves exactly those weights, and no
version went backwards.
"""

from __future__ import annotations

import pytest

from fault_helpers import assert_survived
from weightsync_tools import faults
from weightsync_tools.faults import Rig

# fixtures rig, fault_model: tests/support/fault_fixtures.py
pytestmark = pytest.mark.faults

TRUNCATION_SEEN_AS = {
    "http": "truncated",  # the frame's payload is shorter than its header says
    "shm": "do not fit",  # the slot the engine is pointed at is shorter than the bucket
    "broadcast": "digest",  # gloo receives a short broadcast silently; the digest catches it
    "disk": "truncated",  # the bucket file is shorter than the manifest says
}


@pytest.mark.parametrize("transport", faults.TRANSPORTS)
def test_corrupted_bucket_is_refused_and_the_engine_keeps_its_weights(rig: Rig, transport: str) -> None:
    out = faults.bad_bucket(rig, transport, "flip")
    assert_survived(out, errors=("EngineError",), needles=("digest",), status=400)
    assert "corrupted in transit" in out.error


@pytest.mark.parametrize("transport", faults.TRANSPORTS)
def test_truncated_bucket_is_refused_and_the_engine_keeps_its_weights(rig: Rig, transport: str) -> None:
    out = faults.bad_bucket(rig, transport, "truncate")
    assert_survived(out, errors=("EngineError",), needles=(TRUNCATION_SEEN_AS[transport],), status=400)


@pytest.mark.parametrize("transport", faults.TRANSPORTS)
def test_stalled_engine_is_a_timeout_not_a_hang(rig: Rig, transport: str) -> None:
    out = faults.engine_stalled(rig, transport)
    assert_survived(out, errors=("SyncTimeoutError",), needles=("no answer within", "did not finish within"))
    # The README's bound, from the push's start (the engine stops before bucket 1, a few
    # milliseconds in): timeout_s for the stalled call, min(timeout_s, 10 s) for cleanup.
    assert out.seconds < faults.error_bound_s(rig.timeout_s)
    assert out.seconds < faults.failed_push_bound_s(rig.timeout_s) + faults.SCHEDULING_MARGIN_S, out.seconds
    print(f"\nstalled engine over {transport}: {out.error_type} after {out.seconds:.1f}s (timeout_s={rig.timeout_s})")


@pytest.mark.parametrize("transport", faults.TRANSPORTS)
def test_engine_stalled_before_the_first_push_is_a_timeout(rig: Rig, transport: str) -> None:
    # The engine client is built as the README builds it (its own timeout is 60 s); the
    # push's timeout_s (3 s) bounds even the first calls (capabilities, joining a group).
    out = faults.engine_stalled_before_push(rig, transport)
    assert_survived(out, errors=("SyncTimeoutError",), needles=("no answer within", "did not form within"))
    assert out.seconds < faults.error_bound_s(rig.timeout_s)
    assert out.seconds < faults.failed_push_bound_s(rig.timeout_s) + faults.SCHEDULING_MARGIN_S, out.seconds
    print(f"\nengine stalled before the push over {transport}: {out.error_type} after {out.seconds:.1f}s")


@pytest.mark.parametrize("transport", faults.TRANSPORTS)
def test_engine_killed_mid_stream_then_restarted(rig: Rig, transport: str) -> None:
    out = faults.engine_killed(rig, transport)
    # http/shm/disk: the next call is refused; broadcast: gloo sees the peer close.
    assert_survived(out, errors=("EngineError", "WeightSyncError"),
                    needles=("Connection refused", "Connection closed by peer", "peer"), restarted=True)
    before, restarted, after = out.versions
    assert restarted == (before[0] + 1, 0), "the restarted engine serves its checkpoint as v0"
    assert after[0] == restarted[0] and after[1] > before[1]
