"""HTTP transport, trainer side: packed buckets handed to each engine client,
which posts them as raw bytes in weightsync's binary frame (`wire`).

No base64, no pickle. The bucket buffer goes out as it sits in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from weightsync.transports.base import SlotBuffers, TransportDefaults
from weightsync.types import BucketMeta, Delivery, Link


class HttpTransport(TransportDefaults):
    """Buckets in reusable host buffers, posted by each engine's client."""

    name: ClassVar[str] = "http"
    per_bucket_delivery: ClassVar[bool] = True
    adapter_in_one_bucket: ClassVar[bool] = False
    survives_failure: ClassVar[bool] = True

    def __init__(self, *, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._slots = SlotBuffers()

    def open(self, engine_ranks: Sequence[int], *, max_bucket_bytes: int) -> list[Link]:
        return [Link(transport=self.name, timeout_s=self.timeout_s) for _ in engine_ranks]

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        return self._slots.get(index, nbytes)

    def deliver(self, bucket: BucketMeta, buffer: torch.Tensor, slot: int) -> Delivery:
        return Delivery(transport=self.name, data=buffer)

    def close(self) -> None:
        self._slots.clear()
