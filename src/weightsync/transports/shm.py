"""Shared-memory transport: the trainer packs buckets straight into a /dev/shm segment
(`transports.shmem`, `ShmTransport`) and engines on the same host map it (`ShmReceiver`).

An engine copies a slot out (two slots reused), or, declaring `adopts_shm`, hashes it in place and
serves from it; the trainer then leases every bucket a slot of its own and never writes a slot an
ack still names (`Ack.held_slots`). The segment lives for the session and is replaced when too small
or too full. Slot leasing, memory bounds and the trust it needs: docs/ARCHITECTURE.md ("Design notes").
With `cuda_ipc=True` the slots are one CUDA buffer of the trainer's instead, mapped by engines on the
same GPU (`transports.cuda_ipc`; not yet run on a GPU).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from weightsync.digests import copy_hashed, digest
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta, Manifest
from weightsync.reports import Ack
from weightsync.transports.base import (
    NUM_SLOTS,
    Joined,
    Receiver,
    ReceiverDefaults,
    TransportDefaults,
    typed,
)
from weightsync.transports.cuda_ipc import CudaSlots, encode_handle, export_slots
from weightsync.transports.shmem import NAME_PREFIX, SharedSlots


class ShmReceiver(ReceiverDefaults):
    """The segments an engine process mapped, by name (at most `max_sessions`).

    A mapping is kept while its name and layout stay the same: a fresh mapping
    page-faults every byte of the first copy out of it.
    """

    joins_session: ClassVar[bool] = True

    def __init__(self, *, max_sessions: int = 1, device: torch.device | None = None) -> None:
        self.device = device
        """The CUDA device whose memory a `cuda_ipc` link must name (default: any of this process's)."""
        self._segments: Joined[SharedSlots | CudaSlots] = Joined(max_sessions, _close_slots)
        self._lock = threading.Lock()
        self._adopted: dict[int, tuple[weakref.ref[torch.Tensor], str, int]] = {}
        """id(slot view) -> (the view, its segment, its slot), for the views `adopt` handed out."""

    def join(self, link: Link, *, rank: int) -> None:
        shm = typed(link, ShmLink)
        name, slot_bytes, num_slots = shm.shm_name, shm.slot_bytes, shm.num_slots
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError("slot_bytes and num_slots must be positive")
        with self._lock:
            mapped = self._segments.get(name)
            if shm.cuda_ipc is not None:  # the trainer's CUDA slots, mapped once per session
                layout = (slot_bytes, num_slots)
                if not isinstance(mapped, CudaSlots) or (mapped.slot_bytes, mapped.num_slots) != layout:
                    self._segments.drop(name)
                    self._segments.add(name, CudaSlots.open(shm.cuda_ipc, slot_bytes=slot_bytes, num_slots=num_slots,
                                                            device=self.device))
            elif mapped is None or (mapped.slot_bytes, mapped.num_slots) != (slot_bytes, num_slots):
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
        into.copy_(slot := self._slot(link, bucket, delivery))
        if slot.is_cuda and into.is_cuda:
            torch.cuda.current_stream(into.device).synchronize()  # read before the trainer may reuse the slot
        return into

    def fetch_hashed(self, link: Link, bucket: BucketMeta, delivery: Delivery, into: torch.Tensor,
                     algorithm: str) -> tuple[torch.Tensor, str | None]:
        """The copy out of the slot, hashed piece by piece as it lands (`copy_hashed`); a
        CUDA IPC slot is hashed on its device, then copied."""
        slot = self._slot(link, bucket, delivery)
        if slot.is_cuda:
            hashed = digest(slot, algorithm)
            into.copy_(slot)
            if into.is_cuda:
                torch.cuda.current_stream(into.device).synchronize()  # read before the trainer may reuse the slot
            return into, hashed
        return into, copy_hashed(into, slot, algorithm)

    def adopt(self, link: Link, bucket: BucketMeta, delivery: Delivery) -> torch.Tensor | None:
        """The slot itself, to stage and serve from without copying it out, where the
        link lets the engine adopt (`ShmLink.adopt`: the trainer leases slots); None
        otherwise. The caller hashes it in place before staging it."""
        if not typed(link, ShmLink).adopt:
            return None
        view = self._slot(link, bucket, delivery)
        key = id(view)
        with self._lock:
            self._adopted[key] = (weakref.ref(view, lambda _: self._adopted.pop(key, None)),
                                  typed(link, ShmLink).shm_name, int(delivery.slot))  # type: ignore[arg-type]
        return view

    def lend(self, link: Link, bucket: BucketMeta, delivery: Delivery) -> torch.Tensor | None:
        """The slot in host memory, read in place: the trainer writes it again only once the
        request that delivered it was answered. None for a CUDA IPC slot (copied out)."""
        view = self._slot(link, bucket, delivery)
        return None if view.is_cuda else view

    def held_slots(self, buffers: Iterable[torch.Tensor]) -> dict[str, tuple[int, ...]]:
        """Segment name -> the slots of it that `buffers` (what the engine serves from)
        were adopted from."""
        held: dict[str, set[int]] = {}
        with self._lock:
            for buffer in buffers:
                entry = self._adopted.get(id(buffer))
                if entry is not None and entry[0]() is buffer:
                    held.setdefault(entry[1], set()).add(entry[2])
        return {name: tuple(sorted(slots)) for name, slots in held.items()}

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


def _close_slots(slots: SharedSlots | CudaSlots) -> None:
    slots.close()


@dataclass(frozen=True, kw_only=True)
class ShmLink(Link, transport="shm"):
    """A shared-memory session: the segment engines map and copy buckets out of."""

    shm_name: str
    """Shared memory segment name (under /dev/shm)."""
    slot_bytes: int
    """Bytes per slot of the double buffer."""
    num_slots: int
    """Slots in the segment (2: double buffer; more where the trainer leases slots)."""
    adopt: bool = False
    """The trainer leases slots: the engine may serve a full update from the slots it
    came in, naming them in its acks (`Ack.held_slots`); otherwise it copies them out."""
    cuda_ipc: str | None = None
    """The trainer's slots are one CUDA buffer: its IPC handle (`cuda_ipc.encode_handle`'s
    JSON), mapped in place of the segment `shm_name` would name (none is made)."""


class ShmTransport(TransportDefaults):
    """Buckets packed into slots of a shared-memory segment: two reused slots, or one
    slot per bucket that no engine holds where the engines adopt (`leased_buckets`)."""

    name: ClassVar[str] = "shm"
    receiver: ClassVar[type[Receiver]] = ShmReceiver
    per_bucket_delivery: ClassVar[bool] = True
    adapter_in_one_bucket: ClassVar[bool] = False
    survives_failure: ClassVar[bool] = True
    same_host_only: ClassVar[bool] = True

    def __init__(self, *, timeout_s: float = 60.0, cuda_ipc: bool = False,
                 device: torch.device | str | None = None) -> None:
        self.timeout_s = timeout_s
        self.cuda_ipc = cuda_ipc
        """Slots in one CUDA buffer on `device` (default: the current CUDA device), exported once
        per session to engines on the same GPU; never leased (engines copy out)."""
        self._cuda_device: torch.device | None = None
        if cuda_ipc:
            self._cuda_device = torch.device(device if device is not None else "cuda")
            if self._cuda_device.type != "cuda":
                raise ValueError(f"cuda_ipc=True puts the slots on a CUDA device, not {self._cuda_device}")
        elif device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"the shm transport's slots are in host memory; device={device!r} needs cuda_ipc=True")
        self._segment: SharedSlots | _TrainerCudaSlots | None = None
        self._links: list[Link] = []
        self._leasing = False
        self._held: set[int] = set()
        """Slots an engine may serve from: named in the latest acks, plus every slot of a
        push that failed since (it may have committed on some engine)."""
        self._slots: list[int] = []
        """The slots of the push under way, by bucket index (modulo their number)."""
        self._delivered: set[int] = set()
        """The slots of the push under way handed to engines so far (only those can be held)."""

    @property
    def buffer_device(self) -> torch.device:
        return self._cuda_device or torch.device("cpu")

    def open(self, engine_ranks: Sequence[int], *, max_bucket_bytes: int, leased_buckets: int = 0) -> list[Link]:
        if self.cuda_ipc:
            leased_buckets = 0  # engines copy out of CUDA slots: nothing to lease
        seg, wanted = self._segment, leased_buckets or NUM_SLOTS
        if (seg is not None and seg.slot_bytes >= max_bucket_bytes and len(self._links) == len(engine_ranks)
                and self._leasing == bool(leased_buckets) and len(self._free()) >= wanted):
            return self._links  # the same segment: engines stay connected
        self.close()
        seg = self._segment = (
            _TrainerCudaSlots(slot_bytes=max(1, max_bucket_bytes), num_slots=NUM_SLOTS, device=self._cuda_device)
            if self._cuda_device is not None else
            SharedSlots.create(slot_bytes=max(1, max_bucket_bytes), num_slots=max(NUM_SLOTS, 2 * leased_buckets)))
        self._leasing = bool(leased_buckets)
        handle = seg.handle if isinstance(seg, _TrainerCudaSlots) else None
        self._links = [
            ShmLink(transport=self.name, shm_name=seg.name, slot_bytes=seg.slot_bytes,
                    num_slots=seg.num_slots, adopt=self._leasing, timeout_s=self.timeout_s, cuda_ipc=handle)
            for _ in engine_ranks
        ]
        return self._links

    def begin(self, manifest: Manifest) -> None:
        wanted = len(manifest.buckets) if self._leasing else NUM_SLOTS
        free = self._free()
        if len(free) < wanted:
            raise RuntimeError(f"the shm segment has {len(free)} free slots, the push needs {wanted}: open() "
                               "with leased_buckets first")
        self._slots = free[:wanted]
        self._delivered = set()

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        assert self._segment is not None and self._slots, "open() and begin() first"
        return self._segment.slot(self._slots[index % len(self._slots)], nbytes)

    def deliver(self, bucket: BucketMeta, buffer: torch.Tensor) -> Delivery:
        slot = self._slots[bucket.index % len(self._slots)]
        self._delivered.add(slot)
        if buffer.is_cuda:  # packed on this stream: written before any engine reads it
            torch.cuda.current_stream(buffer.device).synchronize()
        return Delivery(transport=self.name, slot=slot)

    def committed(self, acks: Sequence[Ack]) -> None:
        if self._segment is not None:
            name = self._segment.name
            self._held = {s for ack in acks for s in ack.held_slots.get(name, ())}

    def discard(self, version: int) -> None:
        if self._leasing:  # some engine may have committed before the push failed, serving from what it got
            self._held.update(self._delivered)

    def _free(self) -> list[int]:
        assert self._segment is not None
        return [s for s in range(self._segment.num_slots) if s not in self._held]

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._links = []
        self._held = set()
        self._slots = []
        self._delivered = set()


class _TrainerCudaSlots:
    """The trainer's CUDA slots (`cuda_ipc=True`): one buffer, exported once; named as a
    segment would be (the session's name in the links), with no file behind it."""

    def __init__(self, *, slot_bytes: int, num_slots: int, device: torch.device) -> None:
        import secrets

        from weightsync.owners import owner_tag

        self.name = f"{NAME_PREFIX}{owner_tag()}-{secrets.token_hex(8)}"
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._buffer: torch.Tensor | None = torch.empty(slot_bytes * num_slots, dtype=torch.uint8, device=device)
        self.handle = encode_handle(export_slots(self._buffer))

    def slot(self, index: int, nbytes: int | None = None) -> torch.Tensor:
        assert self._buffer is not None, "closed"
        n = self.slot_bytes if nbytes is None else nbytes
        if not 0 <= index < self.num_slots or not 0 <= n <= self.slot_bytes:
            raise ValueError(f"slot {index} of {n} bytes: the CUDA slots are {self.num_slots} of {self.slot_bytes}")
        start = index * self.slot_bytes
        return self._buffer[start : start + n]

    def close(self) -> None:
        self._buffer = None  # torch keeps the memory while an engine's mapping holds it
