"""NCCL's first collective bounded by `timeout_s` (`formats.groups._bounded`): NCCL builds its
communicator inside the first broadcast, blocking until every rank arrives, where no
`Work.wait(timeout)` reaches (seen on an H200 before the bound: over 70 s with timeout_s=60).
Runs where CUDA is present; skipped, with the reason, everywhere else. Not yet run on a GPU.
The same code path on gloo: tests/faults/test_collective_bounds.py."""

from __future__ import annotations

import time

import pytest
import torch

from weightsync.errors import SyncTimeoutError, WeightSyncError
from weightsync.transports.broadcast import BroadcastTransport

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TIMEOUT_S = 10.0
HANG_GUARD_S = 30.0


def test_nccls_first_broadcast_with_a_peer_that_never_joins_returns_within_timeout_s() -> None:
    transport = BroadcastTransport(device="cuda", timeout_s=TIMEOUT_S)
    assert transport.backend == "nccl"
    try:
        transport.open([1], max_bucket_bytes=1 << 20)
        started = time.monotonic()
        with pytest.raises(SyncTimeoutError, match="did not f"):  # "did not form" or "did not finish"
            transport.establish()  # NCCL forms lazily: this returns, the first broadcast blocks
            buffer = transport.slot(0, 1 << 20)
            transport.send(None, buffer)  # type: ignore[arg-type]
        seconds = time.monotonic() - started
        assert seconds < TIMEOUT_S + HANG_GUARD_S, seconds
        print(f"\nNCCL first broadcast, peer never joined: SyncTimeoutError after {seconds:.1f}s "
              f"(timeout_s={TIMEOUT_S})")
        group = transport._group
        if group is not None:  # the group is broken for good: the next call is refused at once
            with pytest.raises(WeightSyncError, match="the group is unusable"):
                group.broadcast(buffer, timeout_s=TIMEOUT_S)
    finally:
        started = time.monotonic()
        transport.close()
        assert time.monotonic() - started < HANG_GUARD_S, "closing an aborted NCCL group hung"
