"""Whether the served weights are one update's, and whether they may be served.

Tracks which parameters SGLang-shaped requests (applied on arrival, as SGLang does) have rewritten
since the served weights were last one update's, and says whether they are partial (generation goes
on), torn (a request of that update was refused: generation answers 503) or refusing (a streamed
update loaded some buckets and ended without its commit: no request runs at all). It applies nothing:
`server/served.py` asks it, holding the lock. Pure bookkeeping: names in, a verdict out. The states
and what ends them: docs/ARCHITECTURE.md, "Design notes, by module".
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MAX_NAMES_REPORTED = 20


@dataclass(eq=False)
class PartialUpdate:
    """Parameters rewritten since the served weights were last one update's."""

    names: set[str] = field(default_factory=set)
    labels: list[str | None] = field(default_factory=list)
    """Labels of the requests applied, in order (None: the request gave none)."""
    requests: int = 0

    @property
    def label(self) -> str | None:
        return self.labels[-1] if self.labels else None


@dataclass(frozen=True)
class CoverageState:
    """A `Coverage` as it was (`Coverage.saved`)."""

    partial: PartialUpdate | None
    torn: str | None
    refusal: str | None


class Coverage:
    """The served weights' coverage state (see the module docstring)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.all_names = frozenset(names)
        self.partial: PartialUpdate | None = None
        self.torn: str | None = None
        """Why generation is refused; None while the weights may be served."""
        self._session_refusal: str | None = None
        self._streamed: str | None = None
        """The reason a failed streamed commit gave (`streamed_failed`), while it is `torn`."""
        self._lock = threading.Lock()

    @property
    def dirty(self) -> bool:
        return self.partial is not None

    def applied(self, names: Iterable[str], *, label: str | None, atomic: bool) -> None:
        """An update was applied. `atomic`: it was one whole update by construction
        (a weightsync commit); otherwise an SGLang-shaped request or session."""
        with self._lock:
            session_refusal, self._session_refusal = self._session_refusal, None
            if atomic and self.partial is None:
                return
            partial = self.partial = self.partial or PartialUpdate()
            partial.names.update(names)
            partial.labels.append(label)
            partial.requests += 1
            if partial.names >= self.all_names:
                self.partial = None
                self.torn = None
                return
            if session_refusal is not None and self.torn is None:
                self.torn = session_refusal

    def refused(self, *, route: str, label: str | None, message: str, session_open: bool) -> None:
        """An SGLang-shaped update request was refused (after the admin check)."""
        with self._lock:
            reason = (f"the served weights are part of an update whose request to {route} was refused "
                      f"({message}); complete it (resend the refused request), send a full update, "
                      "or revert with /update_weights_from_disk")
            if session_open:
                self._session_refusal = self._session_refusal or reason
                return
            partial = self.partial
            if partial is None or self.torn is not None:
                return
            if label is not None and label != partial.label:
                return
            self.torn = reason

    def streamed_failed(self, loaded: Iterable[str], reason: str) -> None:
        """A streamed commit loaded `loaded` and then failed: the weights are a mix, torn with
        `reason` (generation refused, `refusal`) until an update rewrites every parameter."""
        with self._lock:
            partial = self.partial = self.partial or PartialUpdate()
            partial.names.update(loaded)
            partial.labels.append(None)
            partial.requests += 1
            self.torn = self._streamed = reason

    def refusal(self) -> str | None:
        """Why no request may run, not even one already admitted: a failed streamed commit's
        reason while it stands (other torn states refuse new requests only)."""
        torn = self.torn
        return torn if torn is not None and torn is self._streamed else None

    def saved(self) -> CoverageState:
        """The state now, for `restore` (a rolled-back commit)."""
        with self._lock:
            return CoverageState(copy.deepcopy(self.partial), self.torn, self._session_refusal)

    def restore(self, state: CoverageState) -> None:
        with self._lock:
            self.partial, self.torn, self._session_refusal = copy.deepcopy(state.partial), state.torn, state.refusal

    def released(self) -> None:
        """The parameters were released: nothing is served until every one is rewritten."""
        with self._lock:
            self.partial = PartialUpdate()
            self.torn = ("the weights were released by /release_memory_occupation; call "
                         "/resume_memory_occupation, then send an update of every parameter")

    def reset(self, kept: Iterable[str]) -> None:
        """/weights_checker overwrote every parameter but `kept` with noise: nothing is
        served until an update rewrites them."""
        with self._lock:
            self.partial = PartialUpdate(names=set(kept))
            self.torn = ("the weights were overwritten by /weights_checker with action 'reset_tensors'; "
                         "send an update of every parameter (or /update_weights_from_disk)")

    def resumed(self) -> None:
        """Memory is back, the weights are not: still nothing to serve until an update."""
        with self._lock:
            self.torn = ("the weights were resumed by /resume_memory_occupation but not restored; "
                         "send an update of every parameter (or /update_weights_from_disk)")

    def unservable(self) -> str | None:
        """Why generation must be refused now, or None."""
        return self.torn

    def info(self) -> dict[str, Any] | None:
        """The partial update, for /weightsync/info (None when the weights are one update's)."""
        with self._lock:
            partial = self.partial
            if partial is None:
                return None
            missing = sorted(self.all_names - partial.names)
            return {"label": partial.label, "labels": partial.labels[-MAX_NAMES_REPORTED:],
                    "requests": partial.requests, "num_applied": len(partial.names),
                    "num_missing": len(missing), "missing": missing[:MAX_NAMES_REPORTED], "torn": self.torn}
