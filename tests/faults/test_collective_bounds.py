"""Every collective of a weight-update group, and its forming, returns within `timeout_s`
(`formats.groups._bounded`), also where the call itself blocks: NCCL builds its
communicator inside the first collective, where no `Work.wait(timeout)` reaches (seen on an
H200: over 70 s with timeout_s=60). Run here with gloo over the same code path: the first
broadcast made to block as NCCL's does, a peer that never joins. A peer that stops
mid-broadcast (SIGSTOP): tests/faults/test_engine_faults.py's stalled-engine tests over
broadcast. What only NCCL can show: docs/LIMITS.md."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch.distributed as dist

from weightsync.errors import SyncTimeoutError
from weightsync.formats.groups import host_group, join_group
from weightsync.transports.broadcast import BroadcastTransport
from weightsync_tools.faults import Rig
from weightsync_tools.faults.rig import DictSource

pytestmark = pytest.mark.faults

HANG_GUARD_S = 30.0
"""Slack over timeout_s before a failing call counts as hung: a guard, not a timing claim."""


@contextmanager
def first_broadcast_blocks() -> Iterator[threading.Event]:
    """This process's next `dist.broadcast` call blocks until released, issuing nothing, as
    NCCL's first collective blocks building its communicator while a peer is missing."""
    real = dist.broadcast
    release, entered = threading.Event(), threading.Event()

    def blocking(*args: Any, **kwargs: Any) -> Any:
        if entered.is_set():
            return real(*args, **kwargs)
        entered.set()
        release.wait(120)
        raise RuntimeError("released by the test")

    dist.broadcast = blocking  # type: ignore[assignment]
    try:
        yield entered
    finally:
        dist.broadcast = real
        release.set()


def test_a_first_broadcast_that_blocks_fails_the_push_within_timeout_s(rig: Rig) -> None:
    with rig.sync("broadcast") as sync:
        rig.push(sync)  # the engine on a version of ours
    before = rig.served()
    assert before == rig.expected()
    with rig.sync("broadcast") as sync:  # a new group: its first broadcast is the one that blocks
        with first_broadcast_blocks() as entered:
            started = time.monotonic()
            with pytest.raises(SyncTimeoutError, match=r"broadcast in group .* did not finish within 3\.0s"):
                sync.push(DictSource(rig.new_weights()), version=rig.next_version())
            seconds = time.monotonic() - started
            assert entered.is_set(), "the blocking call was never reached"
        assert seconds < rig.timeout_s + HANG_GUARD_S, seconds
        assert rig.wait_healthy() and rig.served() == before, "the engine keeps its last version"
        rig.push(sync)  # the trainer's next push forms a new group and succeeds
        assert rig.served() == rig.expected()
    print(f"\nfirst broadcast blocked: SyncTimeoutError after {seconds:.1f}s (timeout_s={rig.timeout_s})")


def test_a_peer_that_never_joins_fails_forming_within_timeout_s() -> None:
    transport = BroadcastTransport(timeout_s=1.0)
    try:
        transport.open([1], max_bucket_bytes=64)
        started = time.monotonic()
        with pytest.raises(SyncTimeoutError, match=r"did not form within 1\.0s"):
            transport.establish()  # rank 1 never joins
        assert time.monotonic() - started < 1.0 + HANG_GUARD_S
        assert not transport.is_formed
    finally:
        transport.close()


def test_an_engine_whose_trainer_never_forms_the_group_stops_waiting_within_timeout_s() -> None:
    holder, port = host_group(master_address="127.0.0.1", world_size=2, group_name="never-formed",
                              backend="gloo", timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(SyncTimeoutError, match="joining group 'never-formed'"):
        join_group(master_address="127.0.0.1", master_port=port, rank=1, world_size=2, group_name="never-formed",
                   backend="gloo", timeout_s=1.0)  # rank 0 holds the store but never forms the group
    assert time.monotonic() - started < 1.0 + HANG_GUARD_S
    del holder
