"""`formats.groups._bounded`, what bounds every collective of a weight-update group and its
forming by `timeout_s` (NCCL blocks inside the call that builds its communicator): its value
and errors come through, a call that blocks is abandoned with SyncTimeoutError, and what it
returns after that goes to `on_abandoned`; a group broken by a timeout refuses every later call.
The bound on real groups: tests/faults/test_collective_bounds.py."""

from __future__ import annotations

import threading

import pytest
import torch

from weightsync.errors import SyncTimeoutError, WeightSyncError
from weightsync.formats.groups import UpdateGroup, _bounded


def test_the_value_and_the_error_of_the_call_come_through() -> None:
    assert _bounded(lambda deadline: deadline > 0, 5.0, "a call") is True
    with pytest.raises(KeyError, match="its own"):
        _bounded(lambda _: {}["its own"], 5.0, "a call")


def test_a_call_that_blocks_is_abandoned_and_what_it_returns_late_is_handed_over() -> None:
    release, late = threading.Event(), threading.Event()
    handed: list[str] = []

    def blocks(_: float) -> str:
        release.wait(30)
        return "formed late"

    def on_abandoned(value: str) -> None:
        handed.append(value)
        late.set()

    with pytest.raises(SyncTimeoutError, match=r"building a communicator did not finish within 0\.2s"):
        _bounded(blocks, 0.2, "building a communicator", on_abandoned=on_abandoned)
    release.set()
    assert late.wait(30) and handed == ["formed late"]


def test_a_broken_group_refuses_every_later_call_at_once() -> None:
    group = UpdateGroup(group=None, store=None, rank=0, world_size=2, group_name="g",  # type: ignore[arg-type]
                        backend="gloo", broken="broadcast in group 'g' did not finish within 3.0s")
    with pytest.raises(WeightSyncError, match=r"the group is unusable \(broadcast in group 'g' did not finish"):
        group.broadcast(torch.zeros(1), timeout_s=3.0)
    with pytest.raises(WeightSyncError, match="the group is unusable"):
        group.send(torch.zeros(1), dst=1, tag=1, timeout_s=3.0)
