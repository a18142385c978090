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
the plain `Link` and `Delivery` records of `weightsync.types`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from weightsync.types import Ack, BucketMeta, Delivery, Link, Manifest, PausePolicy

__all__ = ["Completion", "Delivery", "Engine", "Link", "PausePolicy"]


@dataclass(frozen=True, kw_only=True)
class Completion:
    """One generated answer, as the engine reported it."""

    output_ids: list[int]
    """Generated token ids."""
    logprobs: list[float]
    """Log-probability of each generated token under the engine's weights."""
    weight_version: str
    """The weight version the engine reported for this answer."""
    finish_reason: str
    """"length", "stop" or "abort"."""
    text: str = ""
    """Decoded text, where the engine has a tokenizer."""


@runtime_checkable
class Engine(Protocol):
    """A client for one inference engine (one replica, possibly several ranks)."""

    transports: ClassVar[frozenset[str]]
    """Transports this engine can receive full/delta updates over."""
    lora_transports: ClassVar[frozenset[str]]
    """Transports this engine can receive a LoRA adapter over ("disk" = PEFT directory)."""
    label: str
    """How the engine is named in reports and errors (its URL)."""
    # Optional capabilities, read with getattr and these defaults:
    #   stages_updates = False  the engine swaps updates in at commit, so the
    #                           coordinator pauses only around the commit
    #   supports_delta = True   the engine applies a partial ("delta") update
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
