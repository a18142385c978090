"""The step loop: a background thread that advances running requests one token per step.

Requests queue, join the running set (up to `max_running`) between steps and leave it when
they finish; every step runs under `step_lock`. Whoever must act between two steps (a weight
commit, a pause, a digest read) enters `between_steps()`, so a forward pass always sees one
weight version. Paused (SGLang's modes), held and refused states are applied between steps;
what each does: docs/ARCHITECTURE.md's design notes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from weightsync.server.requests import GenRequest, ServedVersion, abort_reason
from weightsync.server.runner import ModelRunner

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
HELD_CHECK_S = 1.0
"""How often a held loop with waiting requests calls `on_held`."""
RESUMED_PAUSES_KEPT = 64
"""Pause ids remembered after their resume: a pause arrives late by one failed push at most."""


def _none() -> None:
    return None


class Scheduler:
    """Owns the request queues and the step thread."""

    def __init__(self, runner: ModelRunner, *, max_running: int, served: Callable[[], ServedVersion],
                 release_adapter: Callable[[Any], None] | None = None, hold: Callable[[], str | None] = _none,
                 refusal: Callable[[], str | None] = _none, on_held: Callable[[], object] = _none) -> None:
        """`hold`, `refusal`, `on_held`: see the module docstring; whoever changes what they
        answer does so inside `between_steps()`, which wakes the loop when it ends."""
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        self.runner = runner
        self.max_running = max_running
        self._served = served
        """The weights in force now (read at the start of each step)."""
        self._release_adapter = release_adapter
        self._hold, self._refusal, self._on_held = hold, refusal, on_held
        self.step_lock = threading.RLock()
        """Held for every step; use `between_steps()` rather than taking it directly."""
        self._cond = threading.Condition()
        self._interrupts = 0
        self._waiting: deque[GenRequest] = deque()
        self._running: list[GenRequest] = []
        self._paused: str | None = None
        self._resumed_pauses: deque[str] = deque(maxlen=RESUMED_PAUSES_KEPT)
        """The pause ids resumes named, newest last (a late pause of one is not applied)."""
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="weightsync-scheduler", daemon=True)
        self.num_steps = 0

    # -- acting between steps ----------------------------------------------------------------

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[None]:
        """Hold the loop between two steps for the duration of the block."""
        with self._cond:
            self._interrupts += 1
        try:
            with self.step_lock:
                yield
        finally:
            with self._cond:
                self._interrupts -= 1
                self._cond.notify_all()

    @property
    def interrupts_pending(self) -> int:
        """Threads waiting for (or holding) the gap between two steps."""
        return self._interrupts

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self.abort_all("server shutting down")

    # -- requests ----------------------------------------------------------------------------

    def submit(self, req: GenRequest) -> None:
        """Queue a request; it runs when there is room and generation is not paused."""
        with self._cond:
            if self._stopping:
                self._finish(req, abort_reason("server shutting down"))
                return
            self._waiting.append(req)
            self._cond.notify_all()

    def cancel(self, req: GenRequest, message: str) -> None:
        """Abort one request (its client went away)."""
        with self.between_steps(), self._cond:
            if req in self._waiting:
                self._waiting.remove(req)
            if req in self._running:
                self._running.remove(req)
            self._finish(req, abort_reason(message))

    def abort_all(self, message: str) -> int:
        """Finish every running and waiting request with finish_reason abort; returns how many."""
        with self.between_steps(), self._cond:
            victims = list(self._running) + list(self._waiting)
            self._running.clear()
            self._waiting.clear()
            for req in victims:
                self._finish(req, abort_reason(message))
            return len(victims)

    def abort_rid(self, rid: str, message: str) -> int:
        """Finish the running or waiting requests with id `rid` (SGLang's `/abort_request`);
        returns how many (0: none such, as SGLang ignores an unknown rid)."""
        with self.between_steps(), self._cond:
            victims = [r for r in list(self._running) + list(self._waiting) if r.rid == rid]
            for req in victims:
                if req in self._running:
                    self._running.remove(req)
                else:
                    self._waiting.remove(req)
                self._finish(req, abort_reason(message))
            return len(victims)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def is_idle(self) -> bool:
        with self._cond:
            return not self._running and not self._waiting

    # -- pausing -----------------------------------------------------------------------------

    @property
    def paused(self) -> str | None:
        """The pause mode in force, or None while generating."""
        return self._paused

    def pause(self, mode: str, *, pause_id: str | None = None) -> int:
        """Stop stepping (returns once no step is in flight) and apply `mode`; returns the
        number of requests affected. A pause whose `pause_id` a resume already named is not
        applied: its caller gave up waiting for it and resumed, and the pause arrived (or
        reached a step boundary) after the resume; applied, it would hold generation until
        the next resume, which may never come."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; one of {list(PAUSE_MODES)}")
        with self.between_steps(), self._cond:
            if pause_id is not None and pause_id in self._resumed_pauses:
                return 0
            self._paused = mode
            if mode == "abort":
                victims = list(self._running) + list(self._waiting)
                self._running.clear()
                self._waiting.clear()
                for req in victims:
                    self._finish(req, abort_reason("generation paused with mode 'abort'"))
                return len(victims)
            if mode == "retract":
                for req in self._running:
                    req.cache = None
            return len(self._running)

    def resume(self, *, pause_id: str | None = None) -> None:
        """Continue generation; `pause_id`: the pause this resume ends, which is then never
        applied should it arrive later."""
        with self._cond:
            if pause_id is not None:
                self._resumed_pauses.append(pause_id)
            self._paused = None
            self._cond.notify_all()

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work, timeout=HELD_CHECK_S)
                if self._stopping:
                    return
                held = (bool(self._waiting or self._running) and self._refusal() is None
                        and self._hold() is not None)
            if held:
                self._on_held()
                continue
            with self.step_lock:
                batch = self._admit()
                if not batch:
                    continue
                self._step(batch)

    def _has_work(self) -> bool:
        if self._stopping:
            return True
        work = bool(self._running or self._waiting)
        if work and self._refusal() is not None:
            return True
        return self._paused is None and self._interrupts == 0 and work and self._hold() is None

    def _admit(self) -> list[GenRequest]:
        """Move waiting requests into the running set; the batch for this step (empty if
        paused or someone waits to act between steps)."""
        with self._cond:
            refusal = self._refusal()
            if refusal is not None:
                victims = self._running + list(self._waiting)
                self._running.clear()
                self._waiting.clear()
                for req in victims:
                    self._finish(req, abort_reason(refusal))
                return []
            if self._paused is not None or self._stopping or self._interrupts or self._hold() is not None:
                return []
            while self._waiting and len(self._running) < self.max_running:
                self._running.append(self._waiting.popleft())
            return list(self._running)

    def _step(self, batch: list[GenRequest]) -> None:
        served = self._served()
        try:
            outcomes = self.runner.step(batch, served=served)
        except Exception as e:
            # The step thread must survive anything a forward pass raises: fail the
            # requests of this step and keep serving the others.
            log.exception("generation step failed")
            with self._cond:
                for req in batch:
                    if req in self._running:
                        self._running.remove(req)
                    self._finish(req, abort_reason(f"internal error in generation step: {type(e).__name__}: {e}"))
            return
        self.num_steps += 1
        with self._cond:
            for outcome in outcomes:
                if outcome.finish_reason is not None:
                    self._running.remove(outcome.request)
                    self._finish(outcome.request, outcome.finish_reason)
            self._cond.notify_all()

    def _finish(self, req: GenRequest, reason: dict[str, Any]) -> None:
        if req.finished:
            return
        req.finish(reason, self.runner.decode)
        if req.adapter is not None and self._release_adapter is not None:
            self._release_adapter(req.adapter)
