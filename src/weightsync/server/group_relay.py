"""The engine side of a relayed broadcast push (`fan_out="relay"` over transport "broadcast").

This engine takes each bucket of a version from the rank before it in the weight-update group,
checks it against the trainer's digest in its hop header (`transports.broadcast.HopHeader`), stages
it, and sends it on to the next engine's rank while it takes the next. A failure is recorded for
the trainer and sent on down the chain. The trainer side is `push/fanout/relay_chain.py`, the relay
over http `server/relay.py`; threads, bounds, failures: docs/ARCHITECTURE.md, "Design notes".
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from weightsync.errors import SyncTimeoutError, WeightSyncError
from weightsync.formats.groups import UpdateGroup
from weightsync.protocol import GroupRelayRequest
from weightsync.server.relay import DEPTH, Relay
from weightsync.server.updates import WeightUpdater
from weightsync.transports.broadcast import HopHeader, recv_hop_header, recv_hop_payload, send_hop

log = logging.getLogger(__name__)

KNOCK_ON_S = 0.5
"""How long a failed operation waits to learn whether the other thread's timed out (and
closed the group's connections here, the cause to report)."""


@dataclass(frozen=True)
class _Outgoing:
    header: HopHeader
    buffer: torch.Tensor | None
    """The staged bucket (the update owns it and keeps it unchanged until commit or abort)."""


class GroupRelay:
    """Relaying one version in one group: `start` it once the update is open here."""

    def __init__(self, request: GroupRelayRequest, *, group: UpdateGroup, updater: WeightUpdater, record: Relay,
                 num_buckets: int, timeout_s: float) -> None:
        self.request = request
        self.group = group
        self.updater = updater
        self.record = record
        self.num_buckets = num_buckets
        self.timeout_s = timeout_s
        self._outgoing: queue.Queue[_Outgoing | None] = queue.Queue(maxsize=DEPTH)
        self._stopped: str | None = None
        """Why the relay of this version stopped here (its buckets are then dropped)."""
        self._lock = threading.Lock()
        self._timed_out = threading.Event()
        """An operation of this relay timed out: gloo closed the group's connections here."""

    def start(self) -> None:
        name = f"weightsync-group-relay-v{self.request.version}"
        threading.Thread(target=self._receive, name=f"{name}-in", daemon=True).start()
        if self.request.forward_rank is not None:
            threading.Thread(target=self._send, name=f"{name}-out", daemon=True).start()

    # -- from the rank before -------------------------------------------------

    def _receive(self) -> None:
        version, src = self.request.version, self.request.source_rank
        source = f"{self.request.source_label} (rank {src})"
        try:
            for _ in range(self.num_buckets):
                try:
                    header = recv_hop_header(self.group, src=src, timeout_s=self.timeout_s)
                except WeightSyncError as e:
                    self._failed(e, f"receiving a bucket of v{version} from {source} failed: {e}")
                    return
                if header.error is not None:  # the sender stopped: nothing more comes
                    self._stop(f"the relay stopped before this engine: {header.error}")
                    return
                if not self._take(header, source):
                    return
        finally:
            if self.request.forward_rank is not None:
                self._outgoing.put(None)  # the sender ends (each of its sends is bounded)

    def _take(self, header: HopHeader, source: str) -> bool:
        """Receive the bytes `header` announces, check and stage them, queue them for the next
        engine; False when nothing more can be received from `source`."""
        version, src = self.request.version, self.request.source_rank
        try:
            if header.version != version:
                raise ValueError(f"a bucket of v{header.version} came in the relay of v{version}")
            expected = self.updater.session.bucket(version, header.index).nbytes
            if header.nbytes != expected:
                raise ValueError(f"bucket {header.index} announced as {header.nbytes} bytes, the manifest's has "
                                 f"{expected}")
        except (ValueError, WeightSyncError) as e:  # no bucket of the open update: its bytes cannot be read
            self._stop(f"bucket {header.index} of v{version} from {source}: {e}")
            return False
        buffer = self.updater.receive_path.buffer(header.nbytes)
        try:
            recv_hop_payload(self.group, buffer, src=src, timeout_s=self.timeout_s)
        except WeightSyncError as e:
            self._failed(e, f"receiving bucket {header.index} of v{version} from {source} failed: {e}")
            return False
        if self._stopped is not None:
            return True  # dropped: the relay of this version already stopped here
        try:  # checks the bytes against header.digest before they are staged or forwarded
            self.updater.receive_path.stage(version=version, index=header.index, buffer=buffer,
                                            digest_hex=header.digest)
        except (ValueError, WeightSyncError) as e:  # recorded for the trainer, which fails the push naming it
            self._stop(f"bucket {header.index} of v{version} from {source} refused: {e}")
            return True
        self._put(_Outgoing(header, buffer))
        return True

    def _put(self, item: _Outgoing) -> None:
        if self.request.forward_rank is None:
            return
        try:
            self._outgoing.put(item, timeout=self.timeout_s / 2)
        except queue.Full:
            self._stop(f"forwarding bucket {item.header.index} of v{self.request.version} to "
                       f"{self.request.forward_label} (rank {self.request.forward_rank}): the buckets before it "
                       f"were not taken within {self.timeout_s / 2:.0f}s (the next engine is slow or gone)",
                       tell_next=False)

    def _failed(self, error: WeightSyncError, message: str, *, tell_next: bool = True) -> None:
        """An operation in the group failed with `error`: stop, with `message` unless the
        failure followed from the other thread's timeout (which is reported instead)."""
        if isinstance(error, SyncTimeoutError):
            self._stop(message, tell_next=tell_next)
            self._timed_out.set()  # once recorded: the failures it brings about come after
            return
        if self._timed_out.wait(KNOCK_ON_S):
            message = f"{message} (after the timeout reported first)"
            tell_next = False  # the group's connections here are closed
        self._stop(message, tell_next=tell_next)

    def _stop(self, message: str, *, tell_next: bool = True) -> None:
        """The relay of this version stops here: recorded, and (`tell_next`) passed down the chain."""
        with self._lock:
            if self._stopped is not None:
                return
            self._stopped = message
        log.warning("relay of v%d: %s", self.request.version, message)
        self.record.fail(self.request.version, message)
        if tell_next:
            self._put(_Outgoing(HopHeader(version=self.request.version, error=message), None))

    # -- to the next rank -----------------------------------------------------

    def _send(self) -> None:
        dst, version = self.request.forward_rank, self.request.version
        assert dst is not None
        broken = False
        while (item := self._outgoing.get()) is not None:
            if broken:
                continue  # the hop is broken: what is left is dropped
            try:
                send_hop(self.group, item.header, item.buffer, dst=dst, timeout_s=self.timeout_s / 2)
            except WeightSyncError as e:
                broken = True
                what = (f"bucket {item.header.index}" if item.header.error is None else "the relay's stop")
                self._failed(e, f"forwarding {what} of v{version} to {self.request.forward_label} (rank {dst}) "
                             f"failed: {e}", tell_next=False)
                continue
            if item.header.error is None:
                self.record.count_forwarded(version)
