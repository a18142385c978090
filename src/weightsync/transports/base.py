"""The Transport protocol: how the trainer side moves packed buckets.

A transport owns the trainer's bucket buffers and the channel to the engines;
it knows nothing about engine APIs. What an engine needs to take part travels
in a `Link` (one per engine, made by `open`) and a `Delivery` (one per bucket).

The coordinator drives a transport like this for every push:

    links = open(engine_ranks, max_bucket_bytes)   # reuses an open session
    establish()          # while every engine runs connect(link)
    begin(manifest)      # a new version starts (disk: a temporary directory)
    for each bucket k:   buffer = slot(k % 2, nbytes); pack into it
                         delivery = deliver(bucket, buffer, k % 2)
                         (engines' receive(bucket, delivery) run here)
                         send(bucket, buffer)  # the broadcast collective
    finish(manifest)     # disk: publish the version directory
    discard(version)     # on failure, instead of finish
    close()              # end of the session (or after a failure)

Two slots: bucket k+2 is packed into the slot of bucket k only after every
engine took bucket k, which bounds trainer memory to 2 x bucket_bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from weightsync.types import BucketMeta, Delivery, Link, Manifest

NUM_SLOTS = 2


@runtime_checkable
class Transport(Protocol):
    """Trainer side of one way to move bytes (disk, http, broadcast, shm)."""

    # Read-only properties, so that a class attribute and a wrapper's instance attribute
    # both satisfy them.
    @property
    def name(self) -> str:
        """Its name in `weightsync.transports.REGISTRY`: "disk", "http", "broadcast" or "shm"."""
        ...

    @property
    def per_bucket_delivery(self) -> bool:
        """False where engines take the whole update at commit (disk)."""
        ...

    @property
    def adapter_in_one_bucket(self) -> bool:
        """A LoRA adapter must travel as one bucket (disk: it is adapter_model.safetensors)."""
        ...

    @property
    def survives_failure(self) -> bool:
        """The session stays usable after a failed push (False for broadcast: a failed
        collective leaves the group broken, so the next push forms a new one)."""
        ...

    def open(self, engine_ranks: Sequence[int], *, max_bucket_bytes: int) -> list[Link]:
        """Prepare a session for engines with these rank counts; one Link each."""
        ...

    def establish(self) -> None:
        """Finish opening while the engines connect (broadcast: form the group)."""
        ...

    def begin(self, manifest: Manifest) -> None:
        """A new version starts streaming."""
        ...

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        """The uint8 buffer bucket slot `index` is packed into (first `nbytes`)."""
        ...

    def deliver(self, bucket: BucketMeta, buffer: torch.Tensor, slot: int) -> Delivery:
        """Make a packed bucket available; tells engines where to find it."""
        ...

    def send(self, bucket: BucketMeta, buffer: torch.Tensor) -> None:
        """Push the bytes while the engines receive (broadcast); no-op elsewhere."""
        ...

    def finish(self, manifest: Manifest) -> None:
        """All buckets are out: publish what engines load at commit (disk)."""
        ...

    def discard(self, version: int) -> None:
        """Throw away a failed version's leftovers."""
        ...

    def close(self) -> None:
        """End the session; idempotent."""
        ...


class SlotBuffers:
    """Two reusable CPU (or device) buffers, grown when a bigger bucket comes.

    Kept across pushes: allocating and page-faulting fresh buffers every push
    costs more than the copy itself.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor | None] = [None] * NUM_SLOTS

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        buf = self._buffers[index]
        if buf is None or buf.numel() < nbytes:
            self._buffers[index] = None
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device,
                              pin_memory=False)
            self._buffers[index] = buf
        return buf[:nbytes]

    def clear(self) -> None:
        self._buffers = [None] * NUM_SLOTS


class TransportDefaults:
    """No-op verbs for transports whose bytes travel inside the engines' receive calls."""

    def establish(self) -> None:
        return None

    def begin(self, manifest: Manifest) -> None:
        return None

    def send(self, bucket: BucketMeta, buffer: torch.Tensor) -> None:
        return None

    def finish(self, manifest: Manifest) -> None:
        return None

    def discard(self, version: int) -> None:
        return None
