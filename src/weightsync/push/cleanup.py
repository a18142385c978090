"""The cleanup a push owes engines that stopped answering, run in the background.

An engine whose call timed out is not waited on again while that push fails: the calls it is owed
(abort, rollback, leaving the session, resume) wait in its `Backlog` and go out once the push has
raised; the next push and `close()` wait for them (`Backlog.wait`). `push/replicas.py` fills it.
It knows nothing of engines or transports: it holds futures and calls. The order it keeps:
docs/ARCHITECTURE.md, "Design notes, by module".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any

from weightsync.errors import SyncTimeoutError, WeightSyncError

log = logging.getLogger(__name__)


@dataclass
class _Owed:
    """What one stalled engine is owed after the current push."""

    label: str
    in_flight: list[Future[Any]] = field(default_factory=list)
    """Its calls that had no answer in time (still running on the pool)."""
    calls: list[tuple[str, Callable[[], object]]] = field(default_factory=list)
    """(what, call) in the order the push asked for them."""


class Backlog:
    """Engines (by index) that timed out in the current push, the cleanup calls they are
    owed, and the background tasks of earlier pushes that make those calls."""

    def __init__(self, pool: Executor, *, settle_s: float) -> None:
        self._pool = pool
        self.settle_s = settle_s
        """How long a background task waits for an engine's calls still in flight before
        it sends what the engine is owed."""
        self._owed: dict[int, _Owed] = {}
        self._running: dict[int, tuple[str, Future[None]]] = {}

    def stalled(self, index: int) -> bool:
        """Whether engine `index` timed out in the current push."""
        return index in self._owed

    def mark(self, index: int, label: str, in_flight: Future[Any] | None = None) -> None:
        """Engine `index` timed out in the current push; `in_flight`: its call still running."""
        owed = self._owed.setdefault(index, _Owed(label))
        if in_flight is not None and not in_flight.done():
            owed.in_flight.append(in_flight)

    def owe(self, index: int, what: str, call: Callable[[], object]) -> None:
        """Make `call` after the push, once engine `index`'s earlier calls have settled."""
        self._owed[index].calls.append((what, call))

    def owed_labels(self) -> list[str]:
        """The engines owed cleanup calls after the current push."""
        return [o.label for o in self._owed.values() if o.calls]

    def start(self) -> None:
        """Hand every stalled engine's backlog to the pool (one task per engine, after that
        engine's task of an earlier push) and forget the current push's state."""
        owed, self._owed = self._owed, {}
        for index, o in owed.items():
            earlier = self._running.get(index)
            if earlier is not None and not earlier[1].done():
                o.in_flight.insert(0, earlier[1])
            if o.in_flight or o.calls:
                self._running[index] = (o.label, self._pool.submit(self._drain, o, self.settle_s))

    def wait(self, timeout_s: float, what: str) -> None:
        """Wait for every background task, at most `timeout_s`; raises SyncTimeoutError
        naming the engines whose cleanup has not finished (it goes on)."""
        running = list(self._running.items())
        if not running:
            return
        done, pending = wait([f for _, (_, f) in running], timeout=timeout_s)
        for index, (_, future) in running:
            if future in done:
                del self._running[index]
                future.result()  # an error other than a WeightSyncError surfaces here
        if pending:
            labels = ", ".join(label for _, (label, f) in running if f in pending)
            raise SyncTimeoutError(f"{labels}: the cleanup after an earlier failed push (abort, leaving the "
                                   f"session, resume) did not finish within {timeout_s:.0f}s, so {what} did not "
                                   "begin; the engine is still not answering")

    @staticmethod
    def _drain(owed: _Owed, settle_s: float) -> None:
        """One engine's backlog: let its calls in flight settle, then make the owed calls in order."""
        deadline = time.monotonic() + settle_s
        for future in owed.in_flight:
            try:  # its outcome, an error included, was the push's to report
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                log.warning("%s: a call of the failed push still has no answer after %.0fs; cleaning up anyway",
                            owed.label, settle_s)
                break
        for what, call in owed.calls:
            try:
                call()
            except WeightSyncError as e:
                log.warning("%s: %s (in the background, after the push failed): %s", owed.label, what, e)
            else:
                log.info("%s: %s (in the background, after the push failed)", owed.label, what)
