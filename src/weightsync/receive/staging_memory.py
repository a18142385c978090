"""Whether a staged commit fits in its host's memory: the estimate made once at `begin`, and the
refusal where it does not fit (`StagingMemoryError`, before a byte moves; the engine keeps serving).

Staging needs, beyond what the process holds at begin, the manifest's bytes plus the dense bytes
of its sparse entries, times the copies staged on this host, less what the engine lets staging
reuse (`StagingReuse`); compared with `process_memory.host_available_bytes` less
`STAGING_MARGIN_BYTES`, and the engine's own limit where one is set. What is and is not seen:
docs/GUARANTEES.md ("A staged commit that does not fit"). A streamed update is never checked here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from weightsync.errors import StagingMemoryError
from weightsync.manifest import Manifest

STAGING_MARGIN_BYTES = 256 * 2**20
"""Bytes of the host's available memory left out of what staging may take: the process's own
allocations meanwhile (requests, generation, the digests' and transports' scratch)."""


@runtime_checkable
class StagingReuse(Protocol):
    """An applier that lets a staged update reuse memory it already holds."""

    def staging_reused_bytes(self, manifest: Manifest) -> int:
        """Bytes this process holds now that staging `manifest` will reuse or free first (buffers
        it lands buckets in, copies let go at begin); 0 where none."""
        ...


def staging_bytes(manifest: Manifest) -> int:
    """Bytes one process staging `manifest` holds at its peak, before any reuse: every bucket,
    plus each sparse entry rebuilt whole at commit."""
    rebuilt = sum(e.numel * e.dtype.itemsize for e in manifest.entries() if not e.is_dense)
    return manifest.num_bytes + rebuilt


def check_staging_fits(manifest: Manifest, *, engine: str, needed_bytes: int, streams: bool,
                       available: Callable[[], int | None], limit_bytes: int | None = None) -> None:
    """Refuse (`StagingMemoryError`) a staged commit of `manifest` that needs `needed_bytes`
    beyond what this process holds, where that is more than `available()` less
    `STAGING_MARGIN_BYTES`, or more than `limit_bytes`. `streams`: the engine takes
    `commit="streamed"`, which the error then names as the fix. `available` answers None where the
    host cannot tell: no check then (a limit is still checked)."""
    host = available()
    room = [(host - STAGING_MARGIN_BYTES, f"this host has {host} available (MemAvailable, of which "
                                          f"{STAGING_MARGIN_BYTES} are left for the process's own allocations)")
            ] if host is not None else []
    if limit_bytes is not None:
        room.append((limit_bytes, f"its staging limit is {limit_bytes} (--staging-bytes-limit)"))
    if not room:
        return
    fits, why = min(room, key=lambda r: r[0])
    if needed_bytes <= fits:
        return
    if streams:
        fix = ("set commit=\"streamed\" (each bucket loaded as it checks, a bucket or two in memory; a push "
               "that fails midway leaves the engine refusing generation until a full push lands; `weightsync "
               "serve` and `vllm serve` take it, an in-process vLLM does not), "
               "or push a smaller update, or give the engine more memory")
    else:
        fix = (f"{engine} does not take commit=\"streamed\" (yet): push a smaller update (a delta, sparse or lora "
               "mode, or a smaller model), or give the engine more memory")
    raise StagingMemoryError(
        f"staged update v{manifest.version} refused before a byte moved, {engine} keeps serving: staging it "
        f"beside the served model needs {needed_bytes} bytes beyond what it holds (the update is "
        f"{manifest.num_bytes} bytes), {why}; {fix}",
        needed_bytes=needed_bytes, available_bytes=max(0, fits))


__all__ = ["STAGING_MARGIN_BYTES", "StagingReuse", "check_staging_fits", "staging_bytes"]
