"""Broadcast transport: one torch.distributed group over the trainer (rank 0, `BroadcastTransport`)
and every engine rank (`BroadcastReceiver`), formed as SGLang's (`formats.groups`).

Each bucket is one `flattened_bucket` broadcast, issued while the engines' receive calls are in
flight (gloo on CPU, NCCL for GPU buckets); the group lives across pushes and is destroyed on close or
any failure. Relayed (`relay=True`), the group carries point-to-point sends hop by hop instead
(`HopHeader`, then the bytes), the engines' side being `server.group_relay`. Design:
docs/ARCHITECTURE.md ("Design notes").
"""

from __future__ import annotations

import json
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from weightsync.errors import IntegrityError
from weightsync.formats.groups import UpdateGroup, finish_hosting, host_group, join_group
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta, Manifest
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


HOP_HEADER_BYTES = 512
"""Size of a relay hop's header tensor (zero-padded JSON behind a magic and a length)."""
HEADER_TAG = 0x5753
"""The tag of a relay hop's headers."""
PAYLOAD_TAG = 0x5754
"""The tag of a relay hop's bucket bytes."""
_HOP_MAGIC = b"WSR1"
_HOP_PREFIX = struct.Struct("<4sI")
_MAX_ERROR_CHARS = 300


@dataclass(frozen=True, kw_only=True)
class HopHeader:
    """What comes before a bucket's bytes on each hop of a relayed push: the bucket, and the
    digest the trainer computed for it (each engine checks the bytes against it before it
    stages or forwards them). With `error`, the relay of `version` stopped before this hop
    (a bucket refused, a peer gone): no bytes follow, and nothing more of this version."""

    version: int
    index: int = -1
    nbytes: int = 0
    digest: str = ""
    error: str | None = None

    def encode(self) -> torch.Tensor:
        """The header as a `HOP_HEADER_BYTES` uint8 tensor."""
        fields: dict[str, Any] = {"version": self.version, "index": self.index, "nbytes": self.nbytes,
                                  "digest": self.digest}
        if self.error is not None:
            fields["error"] = self.error[:_MAX_ERROR_CHARS]
        body = json.dumps(fields, separators=(",", ":")).encode()
        if _HOP_PREFIX.size + len(body) > HOP_HEADER_BYTES:  # an error of many escaped characters
            fields["error"] = "(message too long to relay)"
            body = json.dumps(fields, separators=(",", ":")).encode()
        raw = bytearray(HOP_HEADER_BYTES)
        raw[: _HOP_PREFIX.size + len(body)] = _HOP_PREFIX.pack(_HOP_MAGIC, len(body)) + body
        return torch.frombuffer(raw, dtype=torch.uint8)

    @classmethod
    def decode(cls, raw: torch.Tensor) -> HopHeader:
        """Parse `encode`'s tensor; IntegrityError for anything else."""
        data = raw.numpy().tobytes()
        magic, length = _HOP_PREFIX.unpack_from(data)
        if magic != _HOP_MAGIC or _HOP_PREFIX.size + length > len(data):
            raise IntegrityError(f"not a relay hop header (magic {bytes(magic)!r}, length {length})")
        try:
            d = json.loads(data[_HOP_PREFIX.size : _HOP_PREFIX.size + length])
            error = d.get("error")
            return cls(version=int(d["version"]), index=int(d["index"]), nbytes=int(d["nbytes"]),
                       digest=str(d["digest"]), error=None if error is None else str(error))
        except (ValueError, KeyError, TypeError) as e:
            raise IntegrityError(f"malformed relay hop header: {e}") from None


def send_hop(group: UpdateGroup, header: HopHeader, payload: torch.Tensor | None, *, dst: int,
             timeout_s: float) -> None:
    """Send `header` and then, unless it carries an error, `payload` (host uint8, the
    bucket's bytes) to rank `dst`; each send bounded by `timeout_s`."""
    group.send(header.encode(), dst=dst, tag=HEADER_TAG, timeout_s=timeout_s)
    if header.error is None:
        assert payload is not None and payload.numel() == header.nbytes
        group.send(payload, dst=dst, tag=PAYLOAD_TAG, timeout_s=timeout_s)


def recv_hop_header(group: UpdateGroup, *, src: int, timeout_s: float) -> HopHeader:
    """The next hop header from rank `src`; its bytes follow (`recv_hop_payload`) unless it
    carries an error."""
    raw = torch.empty(HOP_HEADER_BYTES, dtype=torch.uint8)
    group.recv(raw, src=src, tag=HEADER_TAG, timeout_s=timeout_s)
    return HopHeader.decode(raw)


def recv_hop_payload(group: UpdateGroup, into: torch.Tensor, *, src: int, timeout_s: float) -> None:
    """The bucket bytes that follow a header from rank `src`, into `into` (exactly its size)."""
    group.recv(into, src=src, tag=PAYLOAD_TAG, timeout_s=timeout_s)


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
    """Buckets broadcast from the trainer (rank 0) to every engine rank; with `relay`, sent
    to the first engine's rank alone, which forwards them along the others."""

    name: ClassVar[str] = "broadcast"
    receiver: ClassVar[type[Receiver]] = BroadcastReceiver
    per_bucket_delivery: ClassVar[bool] = True
    adapter_in_one_bucket: ClassVar[bool] = False
    survives_failure: ClassVar[bool] = False

    @property
    def buffer_device(self) -> torch.device:
        return self.device

    @property
    def relays(self) -> bool:
        """Each bucket goes to the first engine's rank alone, which forwards it along the
        others (`fan_out="relay"`); needs engines that relay in the group (gloo, one rank each)."""
        return self._relay

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
        relay: bool = False,
    ) -> None:
        self.master_address = master_address
        self._relay = relay
        # NCCL moves CUDA buffers, gloo host buffers: one follows from the other.
        if device is None:
            device = "cuda" if backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend == "gloo" and self.device.type != "cpu":
            # seen on an H200: gloo's group here moves host tensors only ("No backend type associated
            # with device type cuda" at the first broadcast, after the engines began)
            raise ValueError(f"backend='gloo' broadcasts buckets from host memory, not {self.device}: use "
                             "device='cpu' (a trainer on the GPU still casts each tensor there and copies it "
                             "into the host bucket), or backend='nccl' for buckets on the GPU")
        if relay and self.backend != "gloo":
            raise ValueError("relay=True forwards buckets between engines over gloo, from host memory; "
                             "use backend='gloo' (device='cpu'), or relay=False")
        self.timeout_s = timeout_s
        self._slots = SlotBuffers(self.device)
        self._group: UpdateGroup | None = None
        self._pending: UpdateGroup | None = None
        self._links: list[Link] = []
        self._engine_ranks: tuple[int, ...] = ()
        self._version: int | None = None
        """The version streaming now (relayed: each hop header names it)."""

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

    def begin(self, manifest: Manifest) -> None:
        self._version = manifest.version

    def deliver(self, bucket: BucketMeta, buffer: torch.Tensor) -> Delivery:
        return Delivery(transport=self.name)

    def send(self, bucket: BucketMeta, buffer: torch.Tensor) -> None:
        """Broadcast the bucket; relayed, send it to the first engine's rank alone (its hop
        header carries the digest the engines check it against)."""
        assert self._group is not None, "establish() first"
        if not self.relays:
            self._group.broadcast(buffer, src=0, timeout_s=self.timeout_s)
            return
        assert self._version is not None and bucket.digest is not None, "begin() first; buckets are hashed"
        first = typed(self._links[0], BroadcastLink)
        header = HopHeader(version=self._version, index=bucket.index, nbytes=bucket.nbytes, digest=bucket.digest)
        send_hop(self._group, header, buffer, dst=first.rank_offset, timeout_s=self.timeout_s)

    def close(self) -> None:
        if self._group is not None:
            self._group.destroy()
        self._group = None
        self._pending = None
        self._links = []
        self._engine_ranks = ()
        self._slots.clear()
