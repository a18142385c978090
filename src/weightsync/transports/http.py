"""HTTP transport: packed buckets handed to each engine client
(`HttpTransport`), which posts them as raw bytes in weightsync's binary frame
(`weightsync.formats.wire`); the engine copies them out of the request (`HttpReceiver`).

No base64, no pickle. The bucket buffer goes out as it sits in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from weightsync.integrity import byte_view
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta
from weightsync.transports.base import Receiver, ReceiverDefaults, SlotBuffers, TransportDefaults


class HttpReceiver(ReceiverDefaults):
    """The bytes come in the delivery (the body of the client's request): nothing to join."""

    bytes_in_delivery: ClassVar[bool] = True

    def __init__(self, *, max_sessions: int = 1, device: torch.device | None = None) -> None:
        return None

    def fetch(self, link: Link, bucket: BucketMeta, delivery: Delivery, into: torch.Tensor) -> torch.Tensor:
        data = delivery.data
        got = byte_view(data) if isinstance(data, torch.Tensor) else np.frombuffer(memoryview(data), dtype=np.uint8)
        if len(got) != bucket.nbytes:
            raise ValueError(f"bucket {bucket.index}: {len(got)} bytes delivered, the manifest says {bucket.nbytes}")
        if isinstance(got, torch.Tensor):
            return into.copy_(got)
        into.numpy()[:] = got
        return into


class HttpTransport(TransportDefaults):
    """Buckets in reusable host buffers, posted by each engine's client."""

    name: ClassVar[str] = "http"
    receiver: ClassVar[type[Receiver]] = HttpReceiver
    per_bucket_delivery: ClassVar[bool] = True
    adapter_in_one_bucket: ClassVar[bool] = False
    survives_failure: ClassVar[bool] = True

    def __init__(self, *, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._slots = SlotBuffers()

    def open(self, engine_ranks: Sequence[int], *, max_bucket_bytes: int, leased_buckets: int = 0) -> list[Link]:
        return [Link(transport=self.name, timeout_s=self.timeout_s) for _ in engine_ranks]

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        return self._slots.get(index, nbytes)

    def deliver(self, bucket: BucketMeta, buffer: torch.Tensor) -> Delivery:
        return Delivery(transport=self.name, data=buffer)

    def close(self) -> None:
        self._slots.clear()
