"""`send_shares=True`: every trainer rank sends its own share of each bucket
(`push.rank_shares`), to every engine or relayed: this fan-out wraps the direct or the
relay one, which routes each share, and adds what shares need: mode "full", digests in
wsmix64 (combined from the ranks' parts), transport "http", engines that assemble
buckets from shares. Nothing is packed before every engine began.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from weightsync.digests import COMBINABLE, WSMIX64
from weightsync.engines.base import Engine, EngineCapabilities, Extended, ShareReceiver
from weightsync.errors import EngineError
from weightsync.formats.shares import Share
from weightsync.links import Delivery
from weightsync.manifest import BucketMeta, Manifest
from weightsync.push.fanout.base import FanOut, Round, Streaming
from weightsync.push.rank_shares import ShareOrder
from weightsync.transports import receiver_class
from weightsync.transports.base import Transport


class SharesFanOut:
    """Each trainer rank's share of every bucket, routed by `route` (direct or relay)."""

    def __init__(self, route: FanOut, *, transport: str, mode: str, sends_shares: bool,
                 digest_algorithm: str | None) -> None:
        """Refuses a `mode` that does not send every tensor as the ranks hold it
        (`sends_shares`, `PushMode.sends_shares`) and a `digest_algorithm` that cannot be
        combined from parts."""
        if not sends_shares:
            raise ValueError(f"send_shares=True sends every tensor as the trainer ranks hold it, which "
                             f"mode={mode!r} does not: use mode='full'")
        if digest_algorithm not in (None, *COMBINABLE):
            raise ValueError("send_shares=True combines each bucket's digest from the ranks' shares, which only "
                             f"{', '.join(sorted(COMBINABLE))} can: leave digest_algorithm unset")
        self.route = route
        self.transport = transport
        """The transport's name."""
        self.relays = route.relays

    def refuse_unfit(self, replicas: Round, transport: Transport) -> None:
        self.route.refuse_unfit(replicas, transport)
        if not receiver_class(self.transport).bytes_in_delivery:
            raise ValueError(f"send_shares=True sends each trainer rank's share of a bucket in a request of its own, "
                             f"which transport={self.transport!r} does not: use transport='http'")
        for e in replicas.engines:
            if not isinstance(e, (ShareReceiver, Extended)):
                raise ValueError(f"{e.label} cannot take buckets in shares (it needs an engine client that sends "
                                 "them: SGLangEngine on weightsync serve); use send_shares=False")

    def refuse_engine(self, label: str, caps: EngineCapabilities) -> None:
        self.route.refuse_engine(label, caps)
        if not caps.assembles_shares:
            raise EngineError(label, "this engine does not assemble buckets from trainer ranks' "
                              "shares (no `assembles_shares` capability): use send_shares=False")

    def notes(self, engines: Sequence[Engine]) -> list[str]:
        return self.route.notes(engines)

    def start(self, replicas: Round, manifest: Manifest) -> None:
        self.route.start(replicas, manifest)

    def deliver(self, replicas: Round, bucket: BucketMeta, delivery: Delivery, send: Callable[[], None]) -> None:
        self.route.deliver(replicas, bucket, delivery, send)

    def deliver_share(self, replicas: Round, share: Share) -> None:
        self.route.deliver_share(replicas, share)

    def wait_delivered(self, replicas: Round, manifest: Manifest) -> None:
        self.route.wait_delivered(replicas, manifest)

    def stream(self, push: Streaming) -> list[str]:
        """Begin, tell the other ranks which buckets to send their shares of, and send this rank's."""
        push.begin()
        push.transport.begin(push.manifest)
        shares = ShareOrder.of(push.manifest, push.to_engine)
        push.tell_followers({**push.follower_order, "shares": shares.to_message()})
        return push.send_shares(push.source, shares, push.stages)

    def digest_algorithm(self, chosen: Callable[[], str]) -> str:
        return WSMIX64  # the only one combined from the ranks' parts
