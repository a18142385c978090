"""`fan_out="direct"`: the trainer sends every engine every bucket (or share) itself, each
engine's call beside the transport's send; nothing to start or to wait for after."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from weightsync.engines.base import Engine, EngineCapabilities
from weightsync.formats.shares import Share
from weightsync.links import Delivery
from weightsync.manifest import BucketMeta, Manifest
from weightsync.push.fanout.base import Round, Streaming, nothing_to_send, share_receivers, stream_whole_buckets
from weightsync.transports.base import Transport


class DirectFanOut:
    """Every engine takes every bucket from the trainer."""

    relays: bool = False

    def __init__(self, *, transport: str) -> None:
        self.transport = transport
        """The transport's name."""

    def refuse_unfit(self, replicas: Round, transport: Transport) -> None:
        if transport.relays:
            raise ValueError(f"this {self.transport} transport was built to relay (relay=True): pass fan_out='relay', "
                             "or build it with relay=False")

    def refuse_engine(self, label: str, caps: EngineCapabilities) -> None:
        return None

    def notes(self, engines: Sequence[Engine]) -> list[str]:
        return []

    def start(self, replicas: Round, manifest: Manifest) -> None:
        return None

    def deliver(self, replicas: Round, bucket: BucketMeta, delivery: Delivery, send: Callable[[], None]) -> None:
        calls = [(i, functools.partial(e.receive, bucket, delivery, update))
                 for i, (e, update) in enumerate(zip(replicas.engines, replicas.updates, strict=True))]
        replicas.while_sending(calls, send, f"receiving bucket {bucket.index}")

    def deliver_share(self, replicas: Round, share: Share) -> None:
        calls = [(i, functools.partial(e.receive_share, share, (), timeout_s=replicas.timeout_s))
                 for i, e in enumerate(share_receivers(replicas.engines, replicas.timeout_s))]
        replicas.while_sending(calls, nothing_to_send, f"receiving a share of bucket {share.index}")

    def wait_delivered(self, replicas: Round, manifest: Manifest) -> None:
        return None  # every delivery waited for every engine

    def stream(self, push: Streaming) -> list[str]:
        return stream_whole_buckets(push)

    def digest_algorithm(self, chosen: Callable[[], str]) -> str:
        return chosen()

