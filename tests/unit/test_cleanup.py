"""The background cleanup of engines that timed out in a push (`weightsync.push.cleanup.Backlog`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from weightsync.errors import EngineError, SyncTimeoutError
from weightsync.push.cleanup import Backlog


def test_owed_calls_go_out_in_order_after_the_call_in_flight_answered() -> None:
    calls: list[str] = []
    answer = threading.Event()

    def begin() -> None:  # answers once the engine wakes
        answer.wait(60)
        calls.append("begin answered")

    with ThreadPoolExecutor(4) as pool:
        in_flight = pool.submit(begin)
        backlog = Backlog(pool, settle_s=60)
        backlog.mark(0, "engine-0", in_flight)
        assert backlog.stalled(0) and not backlog.stalled(1)
        backlog.owe(0, "abort", lambda: calls.append("abort"))
        backlog.owe(0, "leave", lambda: calls.append("leave"))
        assert backlog.owed_labels() == ["engine-0"]
        backlog.start()
        assert not backlog.stalled(0), "the next push starts with no stalled engine"
        with pytest.raises(SyncTimeoutError, match="engine-0: the cleanup after an earlier failed push"):
            backlog.wait(0.0, "the push of v2")  # the call in flight has not answered: nothing went out
        assert calls == []
        answer.set()
        backlog.wait(60, "the push of v2")
    assert calls == ["begin answered", "abort", "leave"]


def test_a_failing_owed_call_is_logged_and_the_next_one_still_goes_out() -> None:
    calls: list[str] = []

    def refuse() -> None:
        raise EngineError("engine-0", "gone")

    with ThreadPoolExecutor(2) as pool:
        backlog = Backlog(pool, settle_s=1)
        backlog.mark(0, "engine-0")
        backlog.owe(0, "abort", refuse)
        backlog.owe(0, "resume", lambda: calls.append("resume"))
        backlog.start()
        backlog.wait(60, "closing")
    assert calls == ["resume"]


def test_an_engine_marked_with_nothing_owed_starts_no_task() -> None:
    with ThreadPoolExecutor(1) as pool:
        backlog = Backlog(pool, settle_s=1)
        done: Future[None] = Future()
        done.set_result(None)
        backlog.mark(0, "engine-0", done)
        assert backlog.owed_labels() == []
        backlog.start()
        backlog.wait(0.0, "the push of v2")
