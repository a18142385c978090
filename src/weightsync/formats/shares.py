"""Buckets sent in shares (`SyncConfig.send_shares`): each trainer rank frames the byte ranges of a
bucket it holds, and an engine assembles the whole bucket from them.

A share is a bucket frame whose payload is a table of (offset, length) ranges and their bytes, with
its own xxh3_64 digest and the whole bucket's wsmix64 digest. The engine checks each share before it
uses or forwards a byte, and hands the bucket on only once the shares tile it exactly. Pure
bookkeeping and bytes: no I/O. Used by the trainer's ranks (`push/`) and the embedded server; the
wire format: docs/PROTOCOL.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from weightsync.digests import XXH3_64, bytes_tensor, digest, hasher
from weightsync.errors import IntegrityError

RANGE_BYTES = 16
"""One (offset, length) entry of a share's range table."""
SHARE_DIGEST = XXH3_64
"""The algorithm of a share's own digest (a check of its transit, not combined)."""


@dataclass(frozen=True, kw_only=True)
class Share:
    """One trainer rank's part of one bucket, as sent."""

    version: int
    index: int
    """The bucket's index in the manifest."""
    digest: str
    """The whole bucket's digest (the manifest's algorithm, combinable: wsmix64)."""
    ranges: tuple[tuple[int, int], ...]
    """(offset, length) in the bucket of each range this share fills, ascending."""
    data: torch.Tensor = field(repr=False)
    """The ranges' bytes, in order (1-d uint8)."""

    @property
    def nbytes(self) -> int:
        """The payload's length."""
        return RANGE_BYTES * len(self.ranges) + self.data.numel()

    def payload(self) -> list[memoryview]:
        """The frame payload: the range table, then the bytes (no copy of the bytes)."""
        return [memoryview(self._table), self.data.numpy().data.cast("B")]

    def payload_digest(self) -> str:
        """The share's own digest, over its payload (`SHARE_DIGEST`): computed once, however
        many engines the share goes to."""
        return self._digest

    @cached_property
    def _table(self) -> bytes:
        return np.asarray(self.ranges, dtype="<u8").reshape(-1).tobytes()

    @cached_property
    def _digest(self) -> str:
        return hasher(SHARE_DIGEST).update(bytes_tensor(self._table)).update(self.data).hexdigest()


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """`ranges` (ascending, disjoint) with touching neighbours joined; empty ones dropped."""
    out: list[tuple[int, int]] = []
    for offset, length in ranges:
        if not length:
            continue
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((offset, length))
    return tuple(out)


@dataclass
class _Partial:
    buffer: torch.Tensor
    digest: str
    ranges: list[tuple[int, int]] = field(default_factory=list)
    filled: int = 0
    """Bytes the shares taken so far hold (counted before they are copied in)."""
    copied: int = 0
    """Bytes copied into `buffer` so far."""


class Assembly:
    """The buckets an engine is assembling from shares, by (version, index).

    `add` checks one share and copies it in; it returns the whole bucket once the
    shares' ranges tile it. Buckets of an older version are dropped when a share of
    a newer one arrives, or by `drop`. Thread-safe: shares of one bucket may arrive
    at once from several ranks' connections."""

    def __init__(self) -> None:
        self._partials: dict[tuple[int, int], _Partial] = {}
        self._lock = threading.Lock()

    def add(self, *, version: int, index: int, nbytes: int, whole_digest: str, num_ranges: int,
            share_digest: str | None, payload: memoryview, alloc: Callable[[int], torch.Tensor]) -> torch.Tensor | None:
        """Check one share of bucket `index` (`nbytes` long) of `version` and copy its ranges
        into the bucket's buffer (from `alloc(nbytes)` at its first share); the whole
        bucket once every byte arrived exactly once, else None. IntegrityError, naming
        the bucket, for a share whose digest, table or ranges are wrong."""
        where = f"bucket {index} of v{version}"
        data = np.frombuffer(payload, dtype=np.uint8)
        got = digest(payload, SHARE_DIGEST)
        if share_digest is None or got != share_digest:
            raise IntegrityError(f"a share of {where}: digest {got} != sent {share_digest} (corrupted in transit)")
        table_bytes = num_ranges * RANGE_BYTES
        if num_ranges < 0 or table_bytes > len(data):
            raise IntegrityError(f"a share of {where}: a table of {num_ranges} range(s) in {len(data)} bytes")
        table = data[:table_bytes].view("<u8").reshape(-1, 2).astype(np.int64)
        body = data[table_bytes:]
        ranges = [(int(o), int(n)) for o, n in table]
        if sum(n for _, n in ranges) != len(body):
            raise IntegrityError(f"a share of {where}: its ranges hold {sum(n for _, n in ranges)} bytes, "
                                 f"it carries {len(body)}")
        bad = [(o, n) for o, n in ranges if o < 0 or n <= 0 or o + n > nbytes]
        if bad:
            raise IntegrityError(f"a share of {where}: range(s) {bad[:4]} outside the bucket's {nbytes} bytes")
        key = (version, index)
        with self._lock:
            for old in [k for k in self._partials if k[0] < version]:
                del self._partials[old]
            partial = self._partials.get(key)
            if partial is None:
                partial = self._partials[key] = _Partial(buffer=alloc(nbytes), digest=whole_digest)
            if partial.digest != whole_digest:
                raise IntegrityError(f"shares of {where} name two whole-bucket digests: {partial.digest} and "
                                     f"{whole_digest}")
            partial.ranges.extend(ranges)
            partial.filled += len(body)
            if partial.filled > nbytes:
                del self._partials[key]
                raise IntegrityError(f"{where}: shares fill {partial.filled} of its {nbytes} bytes (overlapping "
                                     "shares; each trainer rank must send only its own rows)")
        target = partial.buffer.numpy()
        read = 0
        for offset, length in ranges:
            target[offset:offset + length] = body[read:read + length]
            read += length
        with self._lock:
            partial.copied += len(body)
            if partial.copied < nbytes or self._partials.get(key) is not partial:
                return None
            del self._partials[key]
        _check_tiling(partial.ranges, nbytes, where)
        return partial.buffer

    def drop(self, version: int | None = None) -> None:
        """Forget the buckets being assembled (of `version` only, where given)."""
        with self._lock:
            for key in [k for k in self._partials if version is None or k[0] == version]:
                del self._partials[key]

    def pending(self) -> list[tuple[int, int]]:
        """(version, index) of the buckets still missing shares."""
        with self._lock:
            return sorted(self._partials)


def _check_tiling(ranges: list[tuple[int, int]], nbytes: int, where: str) -> None:
    at = 0
    for offset, length in sorted(ranges):
        if offset > at:
            raise IntegrityError(f"{where}: bytes {at}..{offset} are in no share")
        if offset < at:
            raise IntegrityError(f"{where}: bytes {offset}..{at} are in two shares (each trainer rank must send "
                                 "only its own rows)")
        at = offset + length
    if at != nbytes:
        raise IntegrityError(f"{where}: the shares end at byte {at} of {nbytes}")


__all__ = ["RANGE_BYTES", "SHARE_DIGEST", "Assembly", "Share", "merge_ranges"]
