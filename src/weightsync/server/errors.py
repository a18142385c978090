"""Errors the embedded engine raises for states, not for malformed input.

Malformed input raises ValueError (or a core error deriving from it) and
becomes HTTP 400; these map to other statuses at the HTTP boundary.
"""

from __future__ import annotations

from weightsync.errors import WeightSyncError


class ConflictError(WeightSyncError):
    """The request is valid but clashes with the server's state (HTTP 409): a
    version that is not newer, a session already open, an adapter name taken.
    `retry_after_s` is set when the same request may succeed after that long."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotFoundError(WeightSyncError, ValueError):
    """A named thing does not exist (HTTP 404 for routes, 400 inside /generate)."""
