"""Receive buffers that are reused from one weight update to the next.

A fresh large allocation is page-faulted while the bytes land in it, and on
CPU that costs more than moving the bytes: a gloo receive into fresh 64 MiB
buffers ran at about 40% of the rate into reused ones (`weightsync bench`).
The updater takes a buffer from here for every bucket it receives and gives
the buffers back once a commit has copied them into the served weights (or
the update was dropped), so from the second update on, bytes land in memory
that is already mapped.

Boundaries: only buffers handed out by `take` come back in; the pool never
holds more than `max_bytes` (the served model's size), and a buffer given
back must no longer be read or written by anyone.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch


class BufferPool:
    """Free uint8 CPU buffers by exact size, at most `max_bytes` in all."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._ours: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> buffer handed out
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of exactly `nbytes` (contents undefined): a reused one if free."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._free_bytes -= nbytes
                return free.pop()
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        key = id(buffer)
        with self._lock:
            self._ours[key] = weakref.ref(buffer, lambda _: self._ours.pop(key, None))
        return buffer

    def _is_ours(self, buffer: torch.Tensor) -> bool:
        ref = self._ours.get(id(buffer))
        return ref is not None and ref() is buffer

    def give(self, buffers: Iterable[torch.Tensor]) -> None:
        """Return buffers from `take` that nobody uses any more; others are ignored."""
        with self._lock:
            for buffer in buffers:
                nbytes = buffer.numel()
                if not self._is_ours(buffer) or self._free_bytes + nbytes > self.max_bytes:
                    continue
                if any(b is buffer for b in self._free.get(nbytes, ())):
                    continue
                self._free.setdefault(nbytes, []).append(buffer)
                self._free_bytes += nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
