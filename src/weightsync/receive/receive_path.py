"""The receive path of every engine, written once: fetch a bucket by its link, stage it, ack.

An engine holds two things on its side of an update: its end of each transport
(`transports.Receiver`, which joins sessions and moves bytes) and its update
session (`receiving.UpdateSession`, which checks and stages what arrives and
builds the ack). `ReceivePath` joins them: it keeps the engine's receivers (made
on first use), fetches a bucket through the receiver of its link's transport into
a buffer the session will own and stages it (the session checks its size and
digest), reads a whole version at commit where the transport delivers nothing per
bucket (disk), and names in the ack the transport slots the served weights live in
(`Ack.held_slots`), so that the ack is whole when the session builds it.

What differs between engines is a parameter (`ReceiveHooks`), as the vLLM side of
checkpoint-engine's one receive loop supplies only `run=` and `post_hook=`: where a
bucket's buffer comes from, whether the engine serves from the buffers bytes
arrived in (then a bucket is taken where it lies, not copied), which received
buffers it serves from after a commit, and whether it joins a link's session at
its first bucket or wants it joined before (a `connect`). Both the embedded
server's `/weightsync/receive` and `/weightsync/shm_bucket` routes and the vLLM
worker extension's `receive`, `seal` and `commit` call it.

It moves bytes through receivers and stages them; it never changes a served
weight (that is the session's applier, at commit). Thread-safe as the session is:
buckets may be received from several threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from weightsync.errors import EngineError
from weightsync.links import Delivery, Link
from weightsync.receive.receiving import UpdateSession
from weightsync.reports import Ack
from weightsync.transports.base import Receiver


def host_buffer(nbytes: int) -> torch.Tensor:
    """A fresh host buffer of `nbytes` bytes for one bucket."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _served_nothing() -> Iterable[torch.Tensor]:
    return ()


@dataclass(frozen=True, kw_only=True)
class ReceiveHooks:
    """What differs between engines on the receive path."""

    alloc: Callable[[int], torch.Tensor] = host_buffer
    """A host uint8 buffer of n bytes for one bucket, which the update session then owns
    (the embedded engine: its receive pool; the vLLM worker: a fresh tensor)."""
    serves_received: bool = False
    """The engine serves whole tensors from the buffers they arrived in, so a bucket its
    receiver can hand over where it lies (`Receiver.adopt`: shm slots the trainer leases)
    is staged without a copy; False: every bucket is copied (the vLLM worker reloads
    copies through vLLM's loader and keeps them)."""
    served_buffers: Callable[[], Iterable[torch.Tensor]] = _served_nothing
    """The received buffers the served weights view after a commit (`Ack.held_slots`
    names the adopted ones); nothing where the engine copies every bucket."""
    joins_at_first_bucket: bool = False
    """The engine has no connect verb: it joins a link's session (as rank 0) at the
    link's first bucket. False: a bucket from a session not joined is refused
    (EngineError: connect first)."""


class ReceivePath:
    """One engine's transport receivers and its update session, joined (see the module docstring)."""

    def __init__(self, session: UpdateSession, *, make_receiver: Callable[[str], Receiver],
                 hooks: ReceiveHooks | None = None) -> None:
        """`make_receiver(transport)`: this engine's end of `transport` (`transports.make_receiver`
        with the engine's session count and device)."""
        self.session = session
        self.hooks = hooks or ReceiveHooks()
        self._make_receiver = make_receiver
        self._receivers: dict[str, Receiver] = {}
        """This engine's end of each transport by name, holding the sessions it joined."""
        self._lock = threading.Lock()

    def receiver(self, transport: str) -> Receiver:
        """This engine's end of `transport`, made on first use (ValueError naming the valid
        transports if unknown)."""
        with self._lock:
            receiver = self._receivers.get(transport)
            if receiver is None:
                receiver = self._receivers[transport] = self._make_receiver(transport)
            return receiver

    def receive(self, link: Link, *, version: int, index: int, delivery: Delivery, digest_hex: str | None) -> str:
        """Fetch bucket `index` of the open update `version` from `link`'s session (where
        `delivery` says it lies), stage it into the session, which checks its size, the
        manifest's digest and `digest_hex` (the digest sent with it, if any); returns the
        digest computed here. The bytes are hashed on the way in where the receiver can
        (shm), else by the session; an adopted bucket is hashed in place."""
        session = self.session
        bucket = session.bucket(version, index)  # an open update, a valid index
        receiver = self.receiver(link.transport)
        if receiver.bytes_in_delivery or receiver.reads_at_commit:
            how = "its bytes come in the request" if receiver.bytes_in_delivery else "it is read whole at commit"
            raise EngineError(session.engine, f"no per-bucket receive over transport {link.transport!r}: {how}")
        self._join(receiver, link)
        adopted = (receiver.adopt(link, bucket, delivery)
                   if self.hooks.serves_received and session.serves_whole(version) else None)
        if adopted is not None:
            buffer, computed = adopted, None
        else:
            buffer, computed = receiver.fetch_hashed(link, bucket, delivery, self.hooks.alloc(bucket.nbytes),
                                                     session.digest_algorithm(version))
        return session.stage_bucket(version=version, index=index, buffer=buffer, digest_hex=digest_hex,
                                    computed=computed)

    def read_at_commit(self, link: Link | None, version: int) -> None:
        """Stage the open update `version` from `link`'s version directory, where its
        transport delivers nothing per bucket (disk; every bucket's digest checked);
        nothing to do for other transports, another version, or a sealed update."""
        update = self.session.open_update
        if update is None or update.version != version or link is None or update.sealed is not None:
            return
        receiver = self.receiver(link.transport)
        if receiver.reads_at_commit:
            for index, buffer in receiver.read(link, update.manifest):
                self.session.stage_bucket(version=version, index=index, buffer=buffer)

    def commit(self, version: int, link: Link | None = None) -> Ack:
        """Apply the open update `version` (read first where `link`'s transport delivers at
        commit) and return its ack, naming the slots the served weights now hold."""
        self.read_at_commit(link, version)
        return self.session.commit(version, held_slots=self.held_slots)

    def held_slots(self) -> dict[str, tuple[int, ...]]:
        """Session name -> the transport slots the served weights live in (`Ack.held_slots`)."""
        served = list(self.hooks.served_buffers())
        with self._lock:
            receivers = list(self._receivers.values())
        return {name: slots for receiver in receivers for name, slots in receiver.held_slots(served).items()}

    def close(self) -> None:
        """Leave every session of every receiver; idempotent."""
        with self._lock:
            receivers, self._receivers = list(self._receivers.values()), {}
        for receiver in receivers:
            receiver.close()

    def _join(self, receiver: Receiver, link: Link) -> None:
        """`link`'s session joined, at its first bucket where the engine joins then."""
        try:
            receiver.check_joined(link)
        except LookupError as e:
            if not self.hooks.joins_at_first_bucket:
                raise EngineError(self.session.engine, str(e)) from None
            receiver.join(link, rank=0)


__all__ = ["ReceiveHooks", "ReceivePath", "host_buffer"]
