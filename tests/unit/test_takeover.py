"""The one rule for who may take an engine's open update session (weightsync.receive.takeover)."""

from __future__ import annotations

import pytest

from gone_owner import gone_owner
from weightsync.owners import owner_tag, session_owner
from weightsync.receive.takeover import Holder, SessionBusyError, take_over


def dead_owner() -> str:
    """The session owner of a process of this host that has exited."""
    return gone_owner()[1]


def holder(owner: str | None, *, touched: float = 100.0, timeout_s: float = 3.0) -> Holder:
    return Holder(owner=owner, version=7, timeout_s=timeout_s, touched=touched)


def test_the_owner_itself_begins_again() -> None:
    me = session_owner()
    assert take_over(holder(me), me, now=100.5) is None


def test_a_live_owner_is_never_taken_and_says_when_it_expires() -> None:
    live = session_owner()  # this process: alive
    with pytest.raises(SessionBusyError, match=rf"held by trainer {live}, active 1\.0s ago.*retry in 2\.0s") as e:
        take_over(holder(live), session_owner(), now=101.0)
    assert e.value.retry_after_s == pytest.approx(2.0)


def test_a_gone_owner_is_taken_at_once() -> None:
    gone = dead_owner()
    assert gone.startswith(owner_tag().partition("-")[0])  # same host and pid namespace
    assert "its process is gone" in (take_over(holder(gone), session_owner(), now=100.0) or "")


def test_a_silent_owner_is_taken_after_its_own_timeout() -> None:
    remote = "ffffffff-1/abcd"  # another host: its liveness cannot be judged here
    with pytest.raises(SessionBusyError):
        take_over(holder(remote, timeout_s=3.0), session_owner(), now=102.9)
    assert "silent for 3.1s, past its timeout of 3.0s" in (take_over(holder(remote), session_owner(), now=103.1) or "")


def test_a_session_without_owner_uses_the_fallback_timeout() -> None:
    with pytest.raises(SessionBusyError, match="a trainer that sent no owner"):
        take_over(holder(None, timeout_s=60.0), session_owner(), now=110.0)
    assert take_over(holder(None, timeout_s=60.0), None, now=161.0) is not None
