"""Shared-memory transport, trainer side: a persistent double buffer in
/dev/shm that buckets are packed straight into, and engines on the same host
copy out of.

Zero copies on the trainer beyond packing itself. The segment lives for the
session and is re-created only when a bucket outgrows its slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from weightsync.shmem import SharedSlots
from weightsync.transports.base import NUM_SLOTS, TransportDefaults
from weightsync.types import BucketMeta, Delivery, Link


class ShmTransport(TransportDefaults):
    """Buckets packed into a shared-memory double buffer."""

    name: ClassVar[str] = "shm"
    per_bucket_delivery: ClassVar[bool] = True
    adapter_in_one_bucket: ClassVar[bool] = False
    survives_failure: ClassVar[bool] = True

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
            Link(transport=self.name, shm_name=seg.name, slot_bytes=seg.slot_bytes,
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
