"""Broadcast transport: one torch.distributed group over the trainer (rank 0,
`BroadcastTransport`) and every engine rank (`BroadcastReceiver`), formed as
SGLang's `init_weights_update_group` forms it (see `weightsync.groups`).

Each bucket is one `flattened_bucket` broadcast from rank 0, issued while the
engines' receive calls (SGLang's `update_weights_from_distributed`) are in flight. gloo on CPU,
NCCL when buckets live on a GPU. The group is created once, reused across
pushes, and destroyed on close or after any failure (a collective that timed
out leaves the group unusable).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from weightsync.groups import UpdateGroup, finish_hosting, host_group, join_group
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta
from weightsync.transports.base import (
    Joined,
    Receiver,
    ReceiverDefaults,
    SlotBuffers,
    TransportDefaults,
    typed,
)


@dataclass(frozen=True, kw_only=True)
class BroadcastLink(Link, transport="broadcast"):
    """A weight-update group, formed as SGLang's `init_weights_update_group` forms it."""

    master_address: str
    """Host of the trainer's TCP store (rank 0)."""
    master_port: int
    """Port of the trainer's TCP store."""
    group_name: str
    """Process group name (also the store prefix)."""
    world_size: int
    """1 (trainer) + all engine ranks."""
    rank_offset: int
    """This engine's first rank in the group."""
    backend: str
    """"gloo" or "nccl"."""


class BroadcastReceiver(ReceiverDefaults):
    """The groups an engine process joined, by name (at most `max_sessions`).

    `device`: where NCCL receives land before they are copied to host memory
    (default: the current CUDA device); gloo receives straight into host memory.
    """

    joins_session: ClassVar[bool] = True
    collective: ClassVar[bool] = True

    def __init__(self, *, max_sessions: int = 4, device: torch.device | None = None) -> None:
        self.device = device
        self._groups: Joined[UpdateGroup] = Joined(max_sessions, UpdateGroup.destroy)

    def join(self, link: Link, *, rank: int) -> None:
        group = typed(link, BroadcastLink)
        self._groups.drop(group.group_name)  # a group of the same name is a new session: leave the old one first
        self._groups.add(group.group_name, join_group(
            master_address=group.master_address, master_port=group.master_port,
            rank=group.rank_offset + rank, world_size=group.world_size,
            group_name=group.group_name, backend=group.backend, timeout_s=group.timeout_s,
        ))

    def leave(self, link: Link) -> None:
        self._groups.drop(typed(link, BroadcastLink).group_name)

    def check_joined(self, link: Link) -> None:
        name = typed(link, BroadcastLink).group_name
        if name not in self._groups:
            raise LookupError(f"no broadcast group {name!r}: connect() first")

    def fetch(self, link: Link, bucket: BucketMeta, delivery: Delivery, into: torch.Tensor) -> torch.Tensor:
        self.check_joined(link)
        group = self._groups.get(typed(link, BroadcastLink).group_name)
        assert group is not None
        if group.backend != "nccl":
            group.broadcast(into, src=0, timeout_s=link.timeout_s)
            return into
        device = self.device or torch.device("cuda", torch.cuda.current_device())
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        group.broadcast(buffer, src=0, timeout_s=link.timeout_s)
        return into.copy_(buffer)

    def close(self) -> None:
        self._groups.clear()


class BroadcastTransport(TransportDefaults):
    """Buckets broadcast from the trainer (rank 0) to every engine rank."""

    name: ClassVar[str] = "broadcast"
    receiver: ClassVar[type[Receiver]] = BroadcastReceiver
    per_bucket_delivery: ClassVar[bool] = True
    adapter_in_one_bucket: ClassVar[bool] = False
    survives_failure: ClassVar[bool] = False

    @property
    def buffer_device(self) -> torch.device:
        return self.device

    @property
    def trainer_address(self) -> str:
        """Engines join the group at the trainer's `master_address`."""
        return self.master_address

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

    def open(self, engine_ranks: Sequence[int], *, max_bucket_bytes: int, leased_buckets: int = 0) -> list[Link]:
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
            BroadcastLink(transport=self.name, master_address=self.master_address, master_port=port,
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

    def deliver(self, bucket: BucketMeta, buffer: torch.Tensor) -> Delivery:
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
