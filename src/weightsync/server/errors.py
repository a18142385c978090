"""Errors the embedded engine raises for states, not for malformed input.

Malformed input raises ValueError (or a core error deriving from it) and
becomes HTTP 400; these map to other statuses at the HTTP boundary.
`ConflictError` (409) lives in `weightsync.errors`: every receiving side raises it.
"""

from __future__ import annotations

from weightsync.errors import ConflictError, WeightSyncError


class NotFoundError(WeightSyncError, ValueError):
    """A named thing does not exist (HTTP 404 for routes, 400 inside /generate)."""


__all__ = ["ConflictError", "NotFoundError"]
