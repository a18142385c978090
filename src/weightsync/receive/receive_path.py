"""The receive path, written once for every engine: the one way bytes enter an update session.

Every bucket an engine stages goes through `ReceivePath.stage`, the one caller of
`UpdateSession.stage_bucket`; the ways bytes arrive are its other methods: fetched by a
link (`receive`), read into a `buffer` from a request's body (`stage`), read from a version directory
(`read_at_commit`, `read_version_dir`), or as whole named tensors packed into the
manifest's layout (`stage_as_buckets`). A route or a worker parses its own wire format and
hands the bytes here; what differs between engines is a `ReceiveHooks` (where a bucket's
buffer comes from, whether received buffers are served in place, whether a link's session
is joined at its first bucket). At commit it names in the ack the transport slots the served
weights live in (`held_slots`). It moves bytes and stages them; it never changes a served
weight (the session's applier does, at commit). Thread-safe as the session is.
"""

from __future__ import annotations

import mmap
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from weightsync.bucketing import pack_one
from weightsync.errors import EngineError
from weightsync.formats.version_dir import read_announced
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta
from weightsync.receive.update_session import UpdateSession, check_named
from weightsync.reports import Ack
from weightsync.transports.base import Receiver


def host_buffer(nbytes: int) -> torch.Tensor:
    """A fresh host buffer of `nbytes` bytes for one bucket."""
    return torch.empty(nbytes, dtype=torch.uint8)


def mapped_buffer(nbytes: int) -> torch.Tensor:
    """A host uint8 buffer of `nbytes` bytes in an anonymous mapping of its own, given back to
    the system the moment its last view goes: for a bucket held only while it loads (a
    streamed update's). A heap buffer would not be: glibc keeps up to twice the largest
    bucket it freed (docs/bench/engine-memory.md)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # torch warns that a writable mmap is not read-only: it is not meant to be
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def _served_nothing() -> Iterable[torch.Tensor]:
    return ()


def _no_place(version: int, bucket: BucketMeta) -> torch.Tensor | None:
    return None


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
    bucket_place: Callable[[int, BucketMeta], torch.Tensor | None] = _no_place
    """Where a bucket of update `version` fetched by a link lands, where the engine keeps a place
    for it (the vLLM workers of one engine: their host-shared staging area, `engines.vllm.staging`);
    None: a fresh `alloc` buffer."""
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

    def buffer(self, nbytes: int, version: int | None = None) -> torch.Tensor:
        """A host uint8 buffer of `nbytes` bytes for one bucket of the open update `version`,
        which `stage` then gives the session to own: a streamed update's in a mapping of its
        own, unmapped once the bucket is loaded (`mapped_buffer`); otherwise `ReceiveHooks.alloc`'s."""
        if version is not None and self.session.streams(version):
            return mapped_buffer(nbytes)
        return self.hooks.alloc(nbytes)

    def stage(self, *, version: int, index: int, buffer: torch.Tensor, digest_hex: str | None = None,
              computed: str | None = None) -> str:
        """Stage bucket `index` of the open update `version` from `buffer`, which the session
        then owns: the session checks its size, the manifest's digest and `digest_hex` (the
        digest sent with it, if any). `computed`: the digest of `buffer` this process computed
        as the bytes came in, never one that came with them. Returns the digest computed here.
        Every bucket an engine stages goes through here."""
        return self.session.stage_bucket(version=version, index=index, buffer=buffer, digest_hex=digest_hex,
                                         computed=computed)

    def receive(self, link: Link, *, version: int, index: int, delivery: Delivery, digest_hex: str | None) -> str:
        """Fetch bucket `index` of the open update `version` from `link`'s session (where
        `delivery` says it lies) and stage it; returns the digest computed here. The bytes
        are hashed on the way in where the receiver can (shm), else by the session; an
        adopted bucket is hashed in place."""
        session = self.session
        bucket = session.bucket(version, index)  # an open update, a valid index
        receiver = self.receiver(link.transport)
        if receiver.bytes_in_delivery or receiver.reads_at_commit:
            how = "its bytes come in the request" if receiver.bytes_in_delivery else "it is read whole at commit"
            raise EngineError(session.engine, f"no per-bucket receive over transport {link.transport!r}: {how}")
        self._join(receiver, link)
        if session.streams(version):  # loaded and let go within this call: read where it lies if it can be
            in_place = receiver.lend(link, bucket, delivery)
        elif self.hooks.serves_received and session.serves_whole(version):
            in_place = receiver.adopt(link, bucket, delivery)
        else:
            in_place = None
        if in_place is not None:
            buffer, computed = in_place, None
        else:
            place = self.hooks.bucket_place(version, bucket)
            buffer, computed = receiver.fetch_hashed(link, bucket, delivery,
                                                     self.buffer(bucket.nbytes, version) if place is None else place,
                                                     session.digest_algorithm(version))
        return self.stage(version=version, index=index, buffer=buffer, digest_hex=digest_hex, computed=computed)

    def stage_as_buckets(self, version: int, tensors: Mapping[str, torch.Tensor]) -> list[str]:
        """Stage whole named tensors (every one the open update `version` lists, a PEFT
        directory's), packed into its manifest's bucket layout; each bucket is checked against
        the manifest's digest where it has one. Returns the digests computed here."""
        manifest = self.session.open_manifest(version)
        check_named(list(tensors.items()), {e.hf_name: e.meta for e in manifest.entries()},
                    what=f"update v{version}", full=True)
        digests = []
        for bucket in manifest.buckets:
            buffer = host_buffer(bucket.nbytes)
            for entry in bucket.entries:
                pack_one(buffer, entry, tensors[entry.hf_name])
            digests.append(self.stage(version=version, index=bucket.index, buffer=buffer))
        return digests

    def read_version_dir(self, directory: Path, version: int) -> None:
        """Stage every bucket of the open update `version` from the version directory
        `directory` (manifest.json + bucket files), whose manifest must be the one given at
        begin (`formats.version_dir.check_announced`); every bucket's digest is checked."""
        for bucket, buffer in read_announced(directory, self.session.open_manifest(version),
                                             lambda bucket: self._place(version, bucket)):
            self.stage(version=version, index=bucket.index, buffer=buffer)
            del buffer  # the next bucket is read without this one held (a streamed update let it go)

    def read_at_commit(self, link: Link | None, version: int) -> None:
        """Stage the open update `version` from `link`'s version directory, where its
        transport delivers nothing per bucket (disk; every bucket's digest checked);
        nothing to do for other transports, another version, or a sealed update."""
        update = self.session.open_update
        if update is None or update.version != version or link is None or update.sealed is not None:
            return
        receiver = self.receiver(link.transport)
        if receiver.reads_at_commit:
            for index, buffer in receiver.read(link, update.manifest, lambda bucket: self._place(version, bucket)):
                self.stage(version=version, index=index, buffer=buffer)
                del buffer  # the next bucket is read without this one held (a streamed update let it go)

    def _place(self, version: int, bucket: BucketMeta) -> torch.Tensor:
        """Where bucket `bucket` of update `version` is read to: the place the engine keeps for it
        (`ReceiveHooks.bucket_place`), else a `buffer`."""
        place = self.hooks.bucket_place(version, bucket)
        return self.buffer(bucket.nbytes, version) if place is None else place

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


__all__ = ["ReceiveHooks", "ReceivePath", "host_buffer", "mapped_buffer"]
