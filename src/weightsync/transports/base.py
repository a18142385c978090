"""The two ends of a transport: `Transport` (trainer side) and `Receiver` (engine side).

A transport owns the trainer's bucket buffers and the channel to the engines, and knows nothing of
engine APIs: what an engine needs travels in a `Link` (per engine) and a `Delivery` (per bucket).
Each `transports/<name>.py` holds both ends; engine clients and engine processes read a receiver's
declared traits, never a transport's name. The coordinator (`push/`) drives it; the order of its
calls in a push and the two-slot rule: docs/ARCHITECTURE.md ("How the coordinator drives a transport").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import torch

from weightsync.formats.version_dir import Place, no_place
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta, Manifest
from weightsync.reports import Ack

NUM_SLOTS = 2
T = TypeVar("T")


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

    @property
    def buffer_device(self) -> torch.device:
        """Where buckets are packed and hashed: the CPU, or the GPU for NCCL broadcast
        (whose buckets are then hashed there, with a device digest)."""
        ...

    @property
    def same_host_only(self) -> bool:
        """Engines must run on the trainer's host (shm); `WeightSync` refuses others when built."""
        ...

    @property
    def relays(self) -> bool:
        """Buckets go to the first engine alone, which forwards them along the others
        (`fan_out="relay"`: broadcast built with `relay=True`); False where every engine
        gets every bucket from the trainer (http relays through its engines' own requests)."""
        ...

    @property
    def trainer_address(self) -> str | None:
        """The address of the trainer's host that engines connect to (broadcast: the group's
        `master_address`); None where they connect to nothing of the trainer's."""
        ...

    def open(self, engine_ranks: Sequence[int], *, max_bucket_bytes: int, leased_buckets: int = 0) -> list[Link]:
        """Prepare a session for engines with these rank counts; one Link each.
        `leased_buckets` > 0: the engines keep serving from the buffers a push's buckets
        came in, so the next push needs that many buffers no engine holds (shm; other
        transports copy and ignore it)."""
        ...

    def establish(self) -> None:
        """Finish opening while the engines connect (broadcast: form the group)."""
        ...

    def begin(self, manifest: Manifest) -> None:
        """A new version starts streaming."""
        ...

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        """The uint8 buffer bucket `index` of the push is packed into (its first `nbytes`):
        one of two reused slots, `index % NUM_SLOTS`, unless the push leases slots."""
        ...

    def deliver(self, bucket: BucketMeta, buffer: torch.Tensor) -> Delivery:
        """Make a packed bucket available; tells engines where to find it."""
        ...

    def send(self, bucket: BucketMeta, buffer: torch.Tensor) -> None:
        """Push the bytes while the engines receive (broadcast); no-op elsewhere."""
        ...

    def finish(self, manifest: Manifest) -> None:
        """All buckets are out: publish what engines load at commit (disk)."""
        ...

    def committed(self, acks: Sequence[Ack]) -> None:
        """Every engine committed the push and acked (shm: the slots each now holds)."""
        ...

    def discard(self, version: int) -> None:
        """Throw away a failed version's leftovers."""
        ...

    def close(self) -> None:
        """End the session; idempotent."""
        ...


class Receiver(Protocol):
    """Engine side of one transport, in the engine's process (a `weightsync serve`, a
    vLLM worker): the sessions it joined, and how one bucket's bytes reach it.

    Made by `weightsync.transports.make_receiver(name)`. The declared traits are
    class attributes, read by the engine clients in the trainer process too:
    they decide what an engine must be told, so that no client compares names.

    The engine's update session (`weightsync.receive.update_session`) verifies and stages
    what a receiver hands over; a receiver only moves bytes.
    """

    joins_session: ClassVar[bool]
    """The engine joins the trainer's session before its first update and leaves it
    after (broadcast: the process group; shm: the mapped segment)."""
    bytes_in_delivery: ClassVar[bool]
    """The bytes travel in the `Delivery` itself (http), so the engine client sends
    them in its request; otherwise the engine fetches them from the session."""
    reads_at_commit: ClassVar[bool]
    """Nothing arrives per bucket: the engine reads the whole version at commit (disk)."""
    collective: ClassVar[bool]
    """Each fetch is the engine's half of a collective that runs while the trainer
    sends (broadcast), so the trainer sends only once every engine's fetch is under way."""

    def join(self, link: Link, *, rank: int) -> None:
        """Join the session of `link` as engine rank `rank` (0 for a one-rank engine);
        a session of the same name joined before is left first."""
        ...

    def leave(self, link: Link) -> None:
        """Leave the session of `link`; nothing happens if it was not joined."""
        ...

    def check_joined(self, link: Link) -> None:
        """Raise LookupError naming the session when `link`'s session is not joined."""
        ...

    def fetch(self, link: Link, bucket: BucketMeta, delivery: Delivery, into: torch.Tensor) -> torch.Tensor:
        """Bucket `bucket`'s bytes, copied into `into` (host uint8, `bucket.nbytes`
        long) and returned. broadcast: runs while the trainer broadcasts it."""
        ...

    def fetch_hashed(self, link: Link, bucket: BucketMeta, delivery: Delivery, into: torch.Tensor,
                     algorithm: str) -> tuple[torch.Tensor, str | None]:
        """`fetch`, and the digest (`algorithm`) of the bytes written into `into` where
        the copy computed it on the way (shm: one pass over the bytes, not two); None
        where it did not (the session hashes the bucket itself)."""
        ...

    def adopt(self, link: Link, bucket: BucketMeta, delivery: Delivery) -> torch.Tensor | None:
        """Bucket `bucket`'s bytes where they are, for the engine to serve from without a
        copy (shm, where the link allows it); None where they must be fetched. The
        caller checks their digest in place before staging them."""
        ...

    def lend(self, link: Link, bucket: BucketMeta, delivery: Delivery) -> torch.Tensor | None:
        """Bucket `bucket`'s bytes where they are, to read until the call that asked for
        them returns (a streamed update loads a bucket and lets it go within it: shm slots
        in host memory); None where they must be fetched. The caller checks their digest
        in place and keeps no view."""
        ...

    def held_slots(self, buffers: Iterable[torch.Tensor]) -> dict[str, tuple[int, ...]]:
        """Of `buffers` (what the engine serves from), the ones `adopt` handed out, as
        session name -> slots (`Ack.held_slots`); empty where nothing is adopted."""
        ...

    def read(self, link: Link, manifest: Manifest, place: Place = no_place) -> Iterator[tuple[int, torch.Tensor]]:
        """(bucket index, bytes) of every bucket of `manifest`'s version, at commit
        (disk: read from its version directory, each bucket's digest checked), each read into
        `place(bucket)` where that gives one (the vLLM workers' host-shared staging area)."""
        ...

    def close(self) -> None:
        """Leave every session; idempotent."""
        ...


class ReceiverDefaults:
    """No-op verbs for receivers that join nothing and read nothing at commit."""

    joins_session: ClassVar[bool] = False
    bytes_in_delivery: ClassVar[bool] = False
    reads_at_commit: ClassVar[bool] = False
    collective: ClassVar[bool] = False

    def join(self, link: Link, *, rank: int) -> None:
        return None

    def leave(self, link: Link) -> None:
        return None

    def check_joined(self, link: Link) -> None:
        return None

    def fetch(self, link: Link, bucket: BucketMeta, delivery: Delivery, into: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not fetch buckets")

    def fetch_hashed(self, link: Link, bucket: BucketMeta, delivery: Delivery, into: torch.Tensor,
                     algorithm: str) -> tuple[torch.Tensor, str | None]:
        return self.fetch(link, bucket, delivery, into), None

    def adopt(self, link: Link, bucket: BucketMeta, delivery: Delivery) -> torch.Tensor | None:
        return None

    def lend(self, link: Link, bucket: BucketMeta, delivery: Delivery) -> torch.Tensor | None:
        return None

    def held_slots(self, buffers: Iterable[torch.Tensor]) -> dict[str, tuple[int, ...]]:
        return {}

    def read(self, link: Link, manifest: Manifest, place: Place = no_place) -> Iterator[tuple[int, torch.Tensor]]:
        raise ValueError(f"transport {link.transport!r} delivers every bucket; there is no version to read at commit")

    def close(self) -> None:
        return None


class Joined(Generic[T]):
    """Sessions an engine process joined, by name, at most `max_sessions` of them:
    two trainers may be connected at once (one holds the update, the other waits),
    and trainers that died without leaving leave theirs behind; the oldest go first."""

    def __init__(self, max_sessions: int, leave: Callable[[T], None]) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._leave = leave
        self._by_name: dict[str, T] = {}

    def get(self, name: str) -> T | None:
        return self._by_name.get(name)

    def add(self, name: str, session: T) -> None:
        """Keep `session` as `name`, leaving the oldest beyond `max_sessions`."""
        self.drop(name)
        for old in list(self._by_name)[: max(0, len(self._by_name) - self.max_sessions + 1)]:
            self.drop(old)
        self._by_name[name] = session

    def drop(self, name: str) -> None:
        session = self._by_name.pop(name, None)
        if session is not None:
            self._leave(session)

    def clear(self) -> None:
        for name in list(self._by_name):
            self.drop(name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name


L = TypeVar("L", bound=Link)


def typed(link: Link, kind: type[L]) -> L:
    """`link` as its transport's own link record; ValueError when it is another transport's."""
    if not isinstance(link, kind):
        raise ValueError(f"expected a {kind.__name__}, got a {link.transport!r} link: {link.to_dict()}")
    return link


class SlotBuffers:
    """Two reusable CPU (or device) buffers, grown when a bigger bucket comes.

    Kept across pushes: allocating and page-faulting fresh buffers every push
    costs more than the copy itself.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor | None] = [None] * NUM_SLOTS

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        """Buffer `index % NUM_SLOTS` (`index`: the bucket's), its first `nbytes`."""
        index %= NUM_SLOTS
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

    same_host_only: ClassVar[bool] = False
    """Engines must run on the trainer's host (shm); `WeightSync` refuses others when built."""

    @property
    def trainer_address(self) -> str | None:
        """Engines connect to nothing of the trainer's (see `Transport.trainer_address`)."""
        return None

    @property
    def relays(self) -> bool:
        """Every engine gets every bucket from the trainer (see `Transport.relays`)."""
        return False

    @property
    def buffer_device(self) -> torch.device:
        return torch.device("cpu")

    def establish(self) -> None:
        return None

    def begin(self, manifest: Manifest) -> None:
        return None

    def send(self, bucket: BucketMeta, buffer: torch.Tensor) -> None:
        return None

    def finish(self, manifest: Manifest) -> None:
        return None

    def committed(self, acks: Sequence[Ack]) -> None:
        return None

    def discard(self, version: int) -> None:
        return None
