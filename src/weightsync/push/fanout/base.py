"""What a fan-out is to the coordinator: `FanOut`, the strategy that says how a push's
bytes reach the engines, chosen once when the `WeightSync` is built; `Round`, what it
uses of the engine replicas (`push.replicas.Replicas`); `Streaming`, what it is handed of
the push under way; and what the strategies share (the stream of whole buckets, the
engine clients a share goes to).

A fan-out checks, sends and waits; it keeps no state of a push but what its own rounds
need (a relay's hops in a group), and it never pauses, commits or cleans up: the
coordinator does those the same way for every fan-out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from weightsync.engines.base import Engine, EngineCapabilities, EngineUpdate, Relayer, ShareReceiver, verbs_of
from weightsync.errors import EngineClientError
from weightsync.formats.shares import Share
from weightsync.links import Delivery
from weightsync.manifest import BucketMeta, Manifest
from weightsync.push.pipeline import stream_buckets, threads_beside_engines
from weightsync.push.rank_shares import ShareOrder
from weightsync.reports import Stages
from weightsync.sources import WeightSource
from weightsync.trainer_ranks import TrainerRanks
from weightsync.transports.base import Transport


class Round(Protocol):
    """What a fan-out uses of the engines it delivers to (`push.replicas.Replicas`)."""

    engines: list[Engine]
    updates: list[EngineUpdate]
    """Each engine's update in the push under way (its link among it)."""
    timeout_s: float
    pool: ThreadPoolExecutor

    def all(self, call: Callable[[Any, EngineUpdate], Any], what: str) -> list[Any]:
        """`call(engine, update)` on every engine at once, all answered within timeout_s."""
        ...

    def while_sending(self, calls: Sequence[tuple[int, Callable[[], object]]], send: Callable[[], None],
                      what: str) -> None:
        """Each `(index, call)` on engine `index` while `send` runs here, all answered within timeout_s."""
        ...


@dataclass(frozen=True, kw_only=True)
class Streaming:
    """One phase of a push as the coordinator hands it to its fan-out to stream (`FanOut.stream`)."""

    manifest: Manifest
    """The phase's manifest, without digests."""
    source: WeightSource
    """The mode's source (each rank's share of a tensor is read from it)."""
    stream: WeightSource
    """What whole buckets are packed from (the mode's own stream, or `source`)."""
    bucket_order: Sequence[str]
    """hf_names in stream order (`push.planning.BucketPlan.order`)."""
    to_engine: Mapping[str, str]
    """hf_name -> engine_name of every tensor sent."""
    follower_order: Mapping[str, Any]
    """What the other trainer ranks are told to gather (`push.followers`)."""
    transport: Transport
    ranks: TrainerRanks
    stages: Stages
    allow_overflow: bool
    begin: Callable[[], None]
    """Every engine's begin (once: the fan-out calls it before it delivers the first bucket)."""
    tell_followers: Callable[[dict[str, Any]], None]
    deliver: Callable[[BucketMeta, torch.Tensor], None]
    """One packed bucket to the transport and the engines (`Replicas.receive`)."""
    send_shares: Callable[[WeightSource, ShareOrder, Stages], list[str]]
    """This rank's share of every bucket to the engines (`push.rank_shares.send_shares`)."""


class FanOut(Protocol):
    """How a push's bytes reach the engines: the checks when the sync is built and each
    session, the rounds of a push (start, deliver, wait until delivered), and on the
    trainer's side how the bytes stream and what their digests are."""

    relays: bool
    """The transport made by name is built to relay (a broadcast's point-to-point hops)."""

    def refuse_unfit(self, replicas: Round, transport: Transport) -> None:
        """When the `WeightSync` is built, on the sending rank: a ValueError naming the fix
        where `transport` or an engine client cannot take part in this fan-out."""
        ...

    def refuse_engine(self, label: str, caps: EngineCapabilities) -> None:
        """Once per transport session: an `EngineError` where engine `label` declares it cannot."""
        ...

    def notes(self, engines: Sequence[Engine]) -> list[str]:
        """What the push's report says of this fan-out, after every engine began."""
        ...

    def start(self, replicas: Round, manifest: Manifest) -> None:
        """After every engine began `manifest`, before any bucket is delivered."""
        ...

    def deliver(self, replicas: Round, bucket: BucketMeta, delivery: Delivery, send: Callable[[], None]) -> None:
        """The engines take `bucket` while `send` (the transport's side of it) runs here."""
        ...

    def deliver_share(self, replicas: Round, share: Share) -> None:
        """The engines take one trainer rank's `share` of a bucket."""
        ...

    def wait_delivered(self, replicas: Round, manifest: Manifest) -> None:
        """Return once every engine holds every bucket of `manifest`, or raise naming where not."""
        ...

    def stream(self, push: Streaming) -> list[str]:
        """Begin, stream the phase's bytes to the engines, and return the buckets' digests."""
        ...

    def digest_algorithm(self, chosen: Callable[[], str]) -> str:
        """The algorithm of the push's digests; `chosen()`: the configured one, or by device."""
        ...


def stream_whole_buckets(push: Streaming) -> list[str]:
    """The sending rank packs whole buckets and delivers each (direct and relay). Alone, its
    producer starts packing while the engines check the manifest (nothing is delivered
    before they all began); with other ranks (their gathers are collectives), nothing
    starts before begin."""
    overlap = not push.ranks.is_distributed
    if not overlap:
        push.begin()
    push.transport.begin(push.manifest)
    push.tell_followers(dict(push.follower_order))
    return stream_buckets(
        push.stream, push.manifest.buckets, push.bucket_order, push.to_engine, slot=push.transport.slot,
        deliver=push.deliver, stages=push.stages, allow_overflow=push.allow_overflow,
        drain=push.ranks.is_distributed,  # the other ranks must finish their gathers
        digest_algorithm=push.manifest.digest_algorithm, first=push.begin if overlap else None,
        pack_threads=threads_beside_engines() if push.transport.same_host_only else None)


def share_receivers(engines: Sequence[Engine], timeout_s: float) -> list[ShareReceiver]:
    """Where each of `engines` takes shares (`engines.base.verbs_of`): send_shares refuses an
    engine client that never does when built, and an engine that does not declare it at the
    handshake; a client whose verbs lack `ShareReceiver`'s all the same is an `EngineClientError`."""
    receivers: list[ShareReceiver] = []
    for e in engines:
        verbs = verbs_of(e, timeout_s)
        if not isinstance(verbs, ShareReceiver):
            raise _lacking(e, verbs, "ShareReceiver", "assembles_shares", "receive_share", "send_shares=False")
        receivers.append(verbs)
    return receivers


def relayer(engine: Engine, timeout_s: float) -> Relayer:
    """Where `engine` relays (`engines.base.verbs_of`): fan_out='relay' refuses an engine client
    that never does when built, and an engine that does not declare `relays` at the handshake;
    a client whose verbs lack `Relayer`'s all the same is an `EngineClientError`."""
    verbs = verbs_of(engine, timeout_s)
    if not isinstance(verbs, Relayer):
        raise _lacking(engine, verbs, "Relayer", "relays", "relay, relay_in_group, wait_relayed and relay_error",
                       "fan_out='direct'")
    return verbs


def _lacking(engine: Engine, verbs: object, protocol: str, capability: str, names: str,
             instead: str) -> EngineClientError:
    return EngineClientError(
        f"{engine.label}: the engine declares `{capability}`, but its client's verbs ({type(verbs).__name__}) "
        f"are no `engines.base.{protocol}`: give the client (or what its `extension()` returns) {names}, "
        f"or use {instead}")


def nothing_to_send() -> None:
    """A share's transport side: none, the engine calls carry it."""
