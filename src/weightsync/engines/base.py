"""The Engine protocol: what the coordinator asks of every inference engine.

An engine client (SGLang over HTTP, vLLM through its worker extension) turns
these verbs into the engine's own API. The coordinator calls them in this
order for every push, and `abort` on any failure:

    connect(link)            once per transport session (joins a broadcast
                             group, maps shared memory)
    pause(policy)
    begin(manifest, link)    dry-run check: names, shapes, dtypes; nothing moves
    receive(bucket, delivery)  for every bucket, as it becomes available
    commit(manifest, link) -> Ack
    resume()

Engines never import transports; what a transport tells an engine travels in
the plain `Link` and `Delivery` records below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Protocol, runtime_checkable

from weightsync.types import Ack, BucketMeta, Manifest


class PausePolicy(StrEnum):
    """What happens to in-flight requests while weights change.

    One policy maps onto both engines' own modes:

    | policy   | SGLang `pause_generation` | vLLM `/pause?mode=` |
    |----------|---------------------------|---------------------|
    | none     | (no pause)                | (no pause)          |
    | abort    | abort                     | abort               |
    | retract  | retract                   | wait                |
    | in_place | in_place                  | keep                |

    retract/wait never lose a request; in_place/keep keep the KV cache too.
    """

    NONE = "none"
    ABORT = "abort"
    RETRACT = "retract"
    IN_PLACE = "in_place"

    @property
    def sglang_mode(self) -> str | None:
        return None if self is PausePolicy.NONE else self.value

    @property
    def vllm_mode(self) -> str | None:
        return {
            PausePolicy.NONE: None,
            PausePolicy.ABORT: "abort",
            PausePolicy.RETRACT: "wait",
            PausePolicy.IN_PLACE: "keep",
        }[self]

    @classmethod
    def parse(cls, value: str | PausePolicy) -> PausePolicy:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown pause policy {value!r}; one of {[p.value for p in cls]}") from None


@dataclass(frozen=True, kw_only=True)
class Link:
    """How one engine reaches one transport session (made by the transport).

    Only the fields of `transport` are set.
    """

    transport: str
    """"disk", "http", "broadcast" or "shm"."""
    # broadcast
    master_address: str | None = None
    """Host of the trainer's TCP store (rank 0)."""
    master_port: int | None = None
    """Port of the trainer's TCP store."""
    group_name: str | None = None
    """Process group name (also the store prefix)."""
    world_size: int | None = None
    """1 (trainer) + all engine ranks."""
    rank_offset: int | None = None
    """This engine's first rank in the group."""
    backend: str | None = None
    """"gloo" or "nccl"."""
    # shm
    shm_name: str | None = None
    """Shared memory segment name (under /dev/shm)."""
    slot_bytes: int | None = None
    """Bytes per slot of the double buffer."""
    num_slots: int | None = None
    """Slots in the segment (2: double buffer)."""
    # disk
    root: str | None = None
    """Directory holding `v<version>/` checkpoints."""
    timeout_s: float = 60.0
    """Timeout for the engine's side of every collective and copy."""

    def version_dir(self, version: int) -> str:
        """Disk transport: the final directory of `version`."""
        assert self.root is not None, "version_dir is for disk links"
        return f"{self.root}/v{version:08d}"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Link:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """Where an engine finds one bucket's bytes."""

    transport: str
    """"http": `data` holds the bytes; "broadcast": the engine receives them
    from the group (its receive call runs while the trainer broadcasts);
    "shm": in slot `slot` of the link's segment; "disk": nothing per bucket,
    the engine loads the version directory at commit."""
    data: Any = field(default=None, repr=False)
    """http: a 1-d uint8 tensor or bytes-like with the packed bucket."""
    slot: int | None = None
    """shm: the slot index."""


@runtime_checkable
class Engine(Protocol):
    """A client for one inference engine (one replica, possibly several ranks)."""

    transports: ClassVar[frozenset[str]]
    """Transports this engine can receive full/delta updates over."""
    lora_transports: ClassVar[frozenset[str]]
    """Transports this engine can receive a LoRA adapter over ("disk" = PEFT directory)."""
    label: str
    """How the engine is named in reports and errors (its URL)."""
    num_ranks: int
    """Ranks this engine joins a broadcast group with (its TP size)."""

    def connect(self, link: Link) -> None:
        """Join a transport session (blocks, e.g. until a group forms)."""

    def disconnect(self, link: Link) -> None:
        """Leave a transport session; never raises for an already-gone peer."""

    def pause(self, policy: PausePolicy) -> None:
        """Stop or hold generation per `policy` before an update."""

    def resume(self) -> None:
        """Continue generation after an update (or after an abort)."""

    def begin(self, manifest: Manifest, link: Link) -> None:
        """Check `manifest` against the engine's weights and open an update.

        Raises ManifestMismatchError naming every offender; nothing changes.
        """

    def receive(self, bucket: BucketMeta, delivery: Delivery) -> None:
        """Take one bucket; the engine verifies its digest before use."""

    def commit(self, manifest: Manifest, link: Link) -> Ack:
        """Apply the update, flush caches derived from old weights, ack."""

    def abort(self, version: int) -> None:
        """Discard the open update; the engine keeps its last good version."""
