"""Broadcast transport, trainer side: one torch.distributed group over the
trainer (rank 0) and every engine rank, formed as SGLang's
`init_weights_update_group` forms it (see `weightsync.groups`).

Each bucket is one `flattened_bucket` broadcast from rank 0, issued while the
engines' `update_weights_from_distributed` requests are in flight. gloo on CPU,
NCCL when buckets live on a GPU. The group is created once, reused across
pushes, and destroyed on close or after any failure (a collective that timed
out leaves the group unusable).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import ClassVar

import torch

from weightsync.groups import UpdateGroup, finish_hosting, host_group
from weightsync.transports.base import SlotBuffers, TransportDefaults
from weightsync.types import BucketMeta, Delivery, Link


class BroadcastTransport(TransportDefaults):
    """Buckets broadcast from the trainer (rank 0) to every engine rank."""

    name: ClassVar[str] = "broadcast"
    per_bucket_delivery: ClassVar[bool] = True
    adapter_in_one_bucket: ClassVar[bool] = False
    survives_failure: ClassVar[bool] = False

    def __init__(
        self,
        *,
        master_address: str = "127.0.0.1",
        backend: str | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.master_address = master_address
        # NCCL moves CUDA buffers, gloo host buffers: one follows from the other.
        if device is None:
            device = "cuda" if backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.timeout_s = timeout_s
        self._slots = SlotBuffers(self.device)
        self._group: UpdateGroup | None = None
        self._pending: UpdateGroup | None = None
        self._links: list[Link] = []
        self._engine_ranks: tuple[int, ...] = ()

    def open(self, engine_ranks: Sequence[int], *, max_bucket_bytes: int) -> list[Link]:
        if self._group is not None and tuple(engine_ranks) == self._engine_ranks:
            return self._links  # reuse the formed group
        self.close()
        world_size = 1 + sum(engine_ranks)
        group_name = f"weightsync-{secrets.token_hex(6)}"
        self._pending, port = host_group(
            master_address=self.master_address, world_size=world_size, group_name=group_name,
            backend=self.backend, timeout_s=self.timeout_s,
        )
        offsets = [1 + sum(engine_ranks[:i]) for i in range(len(engine_ranks))]
        self._links = [
            Link(transport=self.name, master_address=self.master_address, master_port=port,
                 group_name=group_name, world_size=world_size, rank_offset=off,
                 backend=self.backend, timeout_s=self.timeout_s)
            for off in offsets
        ]
        self._engine_ranks = tuple(engine_ranks)
        return self._links

    @property
    def is_formed(self) -> bool:
        return self._group is not None

    def establish(self) -> None:
        if self._pending is None:
            return  # already formed
        pending, self._pending = self._pending, None
        self._group = finish_hosting(pending, timeout_s=self.timeout_s)

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        return self._slots.get(index, nbytes)

    def deliver(self, bucket: BucketMeta, buffer: torch.Tensor, slot: int) -> Delivery:
        return Delivery(transport=self.name)

    def send(self, bucket: BucketMeta, buffer: torch.Tensor) -> None:
        assert self._group is not None, "establish() first"
        self._group.broadcast(buffer, src=0, timeout_s=self.timeout_s)

    def close(self) -> None:
        if self._group is not None:
            self._group.destroy()
        self._group = None
        self._pending = None
        self._links = []
        self._engine_ranks = ()
        self._slots.clear()
