"""Shared-memory transport: a persistent double buffer in /dev/shm that the
trainer packs buckets straight into (`ShmTransport`), and engines on the same
host map once and copy out of (`ShmReceiver`); the segment itself is `weightsync.shmem`.

Zero copies on the trainer beyond packing itself. The segment lives for the
session and is re-created only when a bucket outgrows its slots.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from weightsync.digests import copy_hashed
from weightsync.shmem import SharedSlots
from weightsync.transports.base import (
    NUM_SLOTS,
    Joined,
    Receiver,
    ReceiverDefaults,
    TransportDefaults,
    typed,
)
from weightsync.types import BucketMeta, Delivery, Link


class ShmReceiver(ReceiverDefaults):
    """The segments an engine process mapped, by name (at most `max_sessions`).

    A mapping is kept while its name and layout stay the same: a fresh mapping
    page-faults every byte of the first copy out of it.
    """

    joins_session: ClassVar[bool] = True

    def __init__(self, *, max_sessions: int = 1, device: torch.device | None = None) -> None:
        self._segments: Joined[SharedSlots] = Joined(max_sessions, SharedSlots.close)
        self._lock = threading.Lock()

    def join(self, link: Link, *, rank: int) -> None:
        shm = typed(link, ShmLink)
        name, slot_bytes, num_slots = shm.shm_name, shm.slot_bytes, shm.num_slots
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError("slot_bytes and num_slots must be positive")
        with self._lock:
            mapped = self._segments.get(name)
            if mapped is None or (mapped.slot_bytes, mapped.num_slots) != (slot_bytes, num_slots):
                self._segments.add(name, SharedSlots.open(name, slot_bytes=slot_bytes, num_slots=num_slots))

    def leave(self, link: Link) -> None:
        with self._lock:
            self._segments.drop(typed(link, ShmLink).shm_name)

    def check_joined(self, link: Link) -> None:
        """Mapped under the link's name AND with the link's layout (slot size and count)."""
        link = typed(link, ShmLink)
        mapped = self._segments.get(link.shm_name)
        if mapped is None:
            raise LookupError(f"shared memory segment {link.shm_name!r} is not mapped: connect() first")
        if (mapped.slot_bytes, mapped.num_slots) != (link.slot_bytes, link.num_slots):
            raise LookupError(f"shared memory segment {link.shm_name!r} is mapped as {mapped.num_slots} slots of "
                              f"{mapped.slot_bytes} bytes, the link says {link.num_slots} of {link.slot_bytes}: "
                              "connect() first")

    def fetch(self, link: Link, bucket: BucketMeta, delivery: Delivery, into: torch.Tensor) -> torch.Tensor:
        return into.copy_(self._slot(link, bucket, delivery))

    def fetch_hashed(self, link: Link, bucket: BucketMeta, delivery: Delivery, into: torch.Tensor,
                     algorithm: str) -> tuple[torch.Tensor, str | None]:
        """The copy out of the slot, hashed piece by piece as it lands (`copy_hashed`)."""
        return into, copy_hashed(into, self._slot(link, bucket, delivery), algorithm)

    def _slot(self, link: Link, bucket: BucketMeta, delivery: Delivery) -> torch.Tensor:
        self.check_joined(link)
        segment = self._segments.get(typed(link, ShmLink).shm_name)
        assert segment is not None
        if not isinstance(delivery.slot, int):
            raise ValueError(f"an shm delivery names its slot as an integer; got {delivery.slot!r}")
        return segment.slot(delivery.slot, bucket.nbytes)

    def close(self) -> None:
        with self._lock:
            self._segments.clear()


@dataclass(frozen=True, kw_only=True)
class ShmLink(Link, transport="shm"):
    """A shared-memory session: the segment engines map and copy buckets out of."""

    shm_name: str
    """Shared memory segment name (under /dev/shm)."""
    slot_bytes: int
    """Bytes per slot of the double buffer."""
    num_slots: int
    """Slots in the segment (2: double buffer)."""


class ShmTransport(TransportDefaults):
    """Buckets packed into a shared-memory double buffer."""

    name: ClassVar[str] = "shm"
    receiver: ClassVar[type[Receiver]] = ShmReceiver
    per_bucket_delivery: ClassVar[bool] = True
    adapter_in_one_bucket: ClassVar[bool] = False
    survives_failure: ClassVar[bool] = True
    same_host_only: ClassVar[bool] = True

    def __init__(self, *, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._segment: SharedSlots | None = None
        self._links: list[Link] = []

    def open(self, engine_ranks: Sequence[int], *, max_bucket_bytes: int) -> list[Link]:
        if (self._segment is not None and self._segment.slot_bytes >= max_bucket_bytes
                and len(self._links) == len(engine_ranks)):
            return self._links  # the same segment: engines stay connected
        self.close()
        seg = self._segment = SharedSlots.create(slot_bytes=max(1, max_bucket_bytes), num_slots=NUM_SLOTS)
        self._links = [
            ShmLink(transport=self.name, shm_name=seg.name, slot_bytes=seg.slot_bytes,
                 num_slots=seg.num_slots, timeout_s=self.timeout_s)
            for _ in engine_ranks
        ]
        return self._links

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        assert self._segment is not None, "open() first"
        return self._segment.slot(index, nbytes)

    def deliver(self, bucket: BucketMeta, buffer: torch.Tensor, slot: int) -> Delivery:
        return Delivery(transport=self.name, slot=slot)

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._links = []
