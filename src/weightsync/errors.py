"""The errors weightsync raises.

One base class, `WeightSyncError`, and a few subclasses a caller may want to
catch separately. Messages name the offender and, where there is one, the fix.
User mistakes that are plain bad arguments also derive from `ValueError`.
"""

from __future__ import annotations

from collections.abc import Iterable


class WeightSyncError(Exception):
    """Base class of every error weightsync raises on purpose."""


class NamingError(WeightSyncError, ValueError):
    """A trainer parameter could not be mapped to exactly one checkpoint name."""


class ManifestError(WeightSyncError, ValueError):
    """A manifest is malformed: bad JSON, an unknown dtype, overlapping offsets."""


class ManifestMismatchError(WeightSyncError):
    """An engine refused an update at begin: names, shapes or dtypes do not match.

    Carries the offending names so callers can report or fix them.
    """

    def __init__(
        self,
        message: str,
        *,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        mismatched: Iterable[str] = (),
    ) -> None:
        super().__init__(message)
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.mismatched = tuple(mismatched)


class CastError(WeightSyncError, ValueError):
    """Tensors cannot travel in the dtype asked for: engine replicas serve different
    dtypes, or a cast to a dtype of smaller range would turn values into infinities."""


class IntegrityError(WeightSyncError):
    """Bytes arrived wrong: a digest mismatch, a truncated bucket, a bad ack."""


class ConflictError(WeightSyncError):
    """An engine-side request is valid but clashes with the engine's state (HTTP 409):
    a version that is not newer, an update session held by another trainer, an
    adapter name taken. `retry_after_s` is set when the same request may succeed
    after that long. Raised on the engine side; a trainer sees it as EngineError 409."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StagingMemoryError(WeightSyncError):
    """An engine refused a staged update at begin: staging it beside the served model would not
    fit in its host's memory (HTTP 413; the engine keeps serving). Raised on the engine side,
    naming the bytes needed and available and what to set; a trainer sees it as EngineError 413."""

    def __init__(self, message: str, *, needed_bytes: int, available_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


class UnknownLayoutError(ConflictError):
    """A begin named its buckets by a layout digest the engine does not remember (it
    restarted, or began another layout since, or is another engine): HTTP 409 carrying
    `unknown_layout`, and the trainer sends the whole manifest."""

    def __init__(self, layout: str) -> None:
        super().__init__(f"layout {layout[:16]}... is not one this engine remembers (restarted, or another "
                         "layout began since): send the whole manifest")
        self.layout = layout


class EngineError(WeightSyncError):
    """An engine answered with a failure; carries the engine's own message."""

    def __init__(self, engine: str, message: str, *, status: int | None = None,
                 retry_after_s: float | None = None) -> None:
        where = f"{engine} (HTTP {status})" if status is not None else engine
        super().__init__(f"{where}: {message}")
        self.engine = engine
        self.remote_message = message
        self.status = status
        self.retry_after_s = retry_after_s
        """Set when the engine said the same request may succeed after this many seconds
        (another trainer's session that expires then)."""


class AdapterNotLoadedError(EngineError):
    """An engine has no LoRA adapter of the name asked for (an unload found nothing to do)."""


class EngineClientError(WeightSyncError, TypeError):
    """An engine client lacks the verbs its engine declared (`relays` without `Relayer`'s,
    `assembles_shares` without `ShareReceiver`'s): the client's mistake, named with the fix."""


class SyncTimeoutError(WeightSyncError, TimeoutError):
    """A network call or collective did not finish within its timeout."""


def format_names(names: Iterable[str], limit: int = 8) -> str:
    """Render a list of names for an error message, eliding past `limit`."""
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    if len(names) > limit:
        shown += f" ... and {len(names) - limit} more"
    return shown
