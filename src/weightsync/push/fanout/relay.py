"""`fan_out="relay"`: the trainer sends each bucket (or share) to the first engine, which
checks it, stages it and forwards it to the next, along the engines in order, so the
trainer's link carries the model once. Over http each engine forwards in the request
that brought it the bucket (`server/relay.py`); in a broadcast group every engine starts
its hop after begin and the trainer sends to the first engine's rank only
(`relay_chain.py`). Before the commit every engine says it holds every bucket.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from weightsync.engines.base import Engine, EngineCapabilities, Extended, Relayer
from weightsync.errors import EngineError
from weightsync.formats.shares import Share
from weightsync.links import Delivery
from weightsync.manifest import BucketMeta, Manifest
from weightsync.push.fanout.base import (
    Round,
    Streaming,
    nothing_to_send,
    relayer,
    share_receivers,
    stream_whole_buckets,
)
from weightsync.push.fanout.relay_chain import RelayChain
from weightsync.transports import receiver_class
from weightsync.transports.base import Transport


class RelayFanOut:
    """The engines forward each bucket along themselves, in order, from the first."""

    relays: bool = True

    def __init__(self, *, transport: str) -> None:
        self.transport = transport
        """The transport's name."""
        self.in_group = receiver_class(transport).collective
        """Relayed in a broadcast group (point-to-point hops), else over http by the engines."""
        self._chain: RelayChain | None = None
        """In a group: the trainer's side of the chain of hops, from `start`."""

    def refuse_unfit(self, replicas: Round, transport: Transport) -> None:
        """Relays run over http (engines forward the frames they received) and broadcast
        (point-to-point sends in the group, from a transport built with `relay=True`); disk
        engines each read the shared directory, and shm reaches one host, where every engine
        maps the trainer's segment itself: nothing to relay. An engine client that may relay
        (`Relayer`, or one that hands out its engine's own verbs: `Extended`) passes here; its
        engine is refused at the handshake unless it declares `relays` (`refuse_engine`)."""
        if self.in_group and not transport.relays:
            raise ValueError(f"fan_out='relay' over transport={self.transport!r} needs the transport built to relay: "
                             "pass it by name, or build BroadcastTransport(relay=True)")
        if not (receiver_class(self.transport).bytes_in_delivery or self.in_group):
            raise ValueError(f"fan_out='relay' forwards buckets engine to engine over http or broadcast, and "
                             f"transport={self.transport!r} does not send: use transport='http' or 'broadcast', or "
                             "fan_out='direct'")
        for e in replicas.engines:
            if not isinstance(e, (Relayer, Extended)) or e.url is None:
                raise ValueError(f"{e.label} cannot be part of a relay (it needs an engine client that relays, "
                                 "with a URL the other engines reach: SGLangEngine on weightsync serve); "
                                 "use fan_out='direct'")

    def refuse_engine(self, label: str, caps: EngineCapabilities) -> None:
        if not caps.relays:
            raise EngineError(label, "this engine does not forward buckets to other engines "
                              "(no `relays` capability: a stock SGLang cannot relay, `weightsync serve` "
                              "can): use fan_out='direct'")
        if self.in_group and caps.num_ranks != 1:
            raise EngineError(label, f"relayed over {self.transport}, each engine takes part with "
                              f"one rank; this one has {caps.num_ranks}: use fan_out='direct'")

    def notes(self, engines: Sequence[Engine]) -> list[str]:
        return ["relayed: the trainer sent each bucket to " + " -> ".join(e.label for e in engines)]

    def start(self, replicas: Round, manifest: Manifest) -> None:
        """In a group: every engine starts its hop (`RelayChain.start`)."""
        if self.in_group:
            self._chain = RelayChain(replicas)
            self._chain.start(manifest)

    def deliver(self, replicas: Round, bucket: BucketMeta, delivery: Delivery, send: Callable[[], None]) -> None:
        """The first engine takes `bucket` and forwards it along the others (`wait_delivered`
        finds where it stopped): over http in the engine call, in a group from the trainer's
        send alone."""
        if self.in_group:
            assert self._chain is not None, "start() first"
            self._chain.send_first_hop(bucket, send)
            return
        first = relayer(replicas.engines[0], replicas.timeout_s)
        call = functools.partial(first.relay, bucket, delivery, replicas.updates[0], _forward(replicas.engines))
        replicas.while_sending([(0, call)], send, f"receiving bucket {bucket.index}")

    def deliver_share(self, replicas: Round, share: Share) -> None:
        first = share_receivers(replicas.engines[:1], replicas.timeout_s)[0]
        call = functools.partial(first.receive_share, share, _forward(replicas.engines), timeout_s=replicas.timeout_s)
        replicas.while_sending([(0, call)], nothing_to_send, f"receiving a share of bucket {share.index}")

    def wait_delivered(self, replicas: Round, manifest: Manifest) -> None:
        replicas.all(lambda e, update: relayer(e, replicas.timeout_s).wait_relayed(manifest, update),
                     "waiting for the relayed buckets")

    def stream(self, push: Streaming) -> list[str]:
        return stream_whole_buckets(push)

    def digest_algorithm(self, chosen: Callable[[], str]) -> str:
        return chosen()


def _forward(engines: Sequence[Engine]) -> list[str]:
    """The URLs the first engine forwards along: the others', in order."""
    return [e.url for e in engines[1:] if e.url is not None]
