"""Who holds an engine's open update session, and when another trainer may take it.

One rule for every receiving side (`receive/update_session.py`, `server/updates.py`), so a crashed
trainer never locks an engine: a newcomer takes a session whose owner is provably gone or silent
past its own `timeout_s`, and is refused with `SessionBusyError` otherwise (docs/GUARANTEES.md, 3;
the rest of the rule: docs/ARCHITECTURE.md, "Design notes"). Pure: the caller passes the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.owners import session_owner_gone


class SessionBusyError(Exception):
    """Another live trainer holds the session (HTTP 409 with `retry_after_s`)."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(kw_only=True)
class Holder:
    """The trainer behind an open session and its last sign of life."""

    owner: str | None
    """`owners.session_owner()` of the trainer, or None for a client that sent none."""
    version: int | None
    """The version the session would commit."""
    timeout_s: float
    """How long the owner may stay silent before the session may be taken."""
    touched: float
    """Monotonic time of the owner's last request or received bucket."""

    def silent_for(self, now: float) -> float:
        return max(0.0, now - self.touched)


def take_over(holder: Holder, newcomer: str | None, now: float) -> str | None:
    """Whether `newcomer` may replace `holder`'s session now.

    Returns None when the holder is the newcomer itself, a reason string when the
    session may be preempted (for logs and the newcomer's report), and raises
    `SessionBusyError` when the holder is alive.
    """
    if holder.owner is not None and holder.owner == newcomer:
        return None
    who = f"trainer {holder.owner}" if holder.owner else "a trainer that sent no owner"
    if holder.owner is not None and session_owner_gone(holder.owner):
        return f"discarded the update session v{holder.version} of {who}: its process is gone"
    silent = holder.silent_for(now)
    if silent > holder.timeout_s:
        return (f"discarded the update session v{holder.version} of {who}: silent for {silent:.1f}s, "
                f"past its timeout of {holder.timeout_s:.1f}s")
    wait = holder.timeout_s - silent
    raise SessionBusyError(
        f"an update session (v{holder.version}) is held by {who}, active {silent:.1f}s ago; it is "
        f"discarded once that trainer is gone or silent for {holder.timeout_s:.1f}s: retry in {wait:.1f}s",
        retry_after_s=wait,
    )
