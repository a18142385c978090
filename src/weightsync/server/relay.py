"""The engine side of a relayed push over http (`fan_out="relay"`).

Each bucket frame names the engines it goes on to (`formats.wire.FrameHeader.forward`); once it is
checked against its digest and staged here, this engine sends it to the first of them, with the
rest, while it takes the next, so the trainer's link carries each bucket once. A bucket it cannot
forward is its relay error for that version, in `/weightsync/info`. A broadcast group relays in
`server/group_relay.py`; backpressure and failures: docs/ARCHITECTURE.md, "Design notes".
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, replace
from typing import Any

import httpx

from weightsync.formats.wire import FrameHeader, body_chunks, encode_prefix
from weightsync.protocol import BUCKET_ROUTE

log = logging.getLogger(__name__)

DEPTH = 2
"""Buckets staged here and not yet forwarded, at most (each held in memory until sent)."""
VERSIONS_KEPT = 16
"""Versions whose forwarded counts and relay errors are remembered (the trainer asks about
the open one)."""


@dataclass(frozen=True)
class _Hop:
    header: FrameHeader
    """The frame's header for the next engine (its `forward`: the hops after it)."""
    payload: memoryview
    url: str
    authorization: str | None
    timeout_s: float


class RelayError(Exception):
    """A relayed bucket could not be passed on (HTTP 504 to the engine before this one)."""


class Relay:
    """This engine's forwarding of relayed buckets, in a thread of its own."""

    def __init__(self) -> None:
        self._queue: queue.Queue[_Hop | None] = queue.Queue(maxsize=DEPTH)
        self._errors: dict[int, str] = {}
        self._forwarded: dict[int, int] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._client = httpx.Client()

    def forward(self, header: FrameHeader, payload: memoryview, *, authorization: str | None,
                timeout_s: float) -> None:
        """Queue the staged bucket `header` names for the next engine of its `forward` list
        (blocks while `DEPTH` buckets wait). `payload` must stay unchanged until sent. Each
        wait here and each send is bounded by half the update's `timeout_s`, so this engine
        names the broken hop (`RelayError`) before the trainer's own bound on it runs out."""
        failed = self.error(header.version)
        if failed is not None:  # the relay of this version already broke here: say where, at once
            raise RelayError(failed)
        url, *rest = header.forward
        hop = _Hop(header=replace(header, forward=tuple(rest)),
                   payload=payload, url=url.rstrip("/"), authorization=authorization, timeout_s=timeout_s / 2)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="weightsync-relay", daemon=True)
                self._thread.start()
        try:
            self._queue.put(hop, timeout=hop.timeout_s)
        except queue.Full:
            message = (f"forwarding bucket {header.index} of v{header.version} to {hop.url}: the buckets before it "
                       f"were not taken within {hop.timeout_s:.0f}s (the next engine is slow, gone or unreachable)")
            self.fail(header.version, message)
            raise RelayError(message) from None

    def fail(self, version: int, message: str) -> None:
        """Record why relaying `version` stopped here (the first reason is kept)."""
        with self._lock:
            self._errors.setdefault(version, message)
            _keep_recent(self._errors)

    def count_forwarded(self, version: int) -> None:
        """One more bucket of `version` went to the next engine."""
        with self._lock:
            self._forwarded[version] = self._forwarded.get(version, 0) + 1
            _keep_recent(self._forwarded)

    def error(self, version: int) -> str | None:
        """Why relaying a bucket of `version` failed here, or None."""
        with self._lock:
            return self._errors.get(version)

    def forwarded_counts(self) -> dict[str, int]:
        """Version -> buckets forwarded, for the recent versions (JSON keys)."""
        with self._lock:
            return {str(v): n for v, n in self._forwarded.items()}

    def errors(self) -> dict[str, str]:
        """Version -> why forwarding stopped, for the recent versions that failed."""
        with self._lock:
            return {str(v): e for v, e in self._errors.items()}

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
        self._client.close()

    def _run(self) -> None:
        while (hop := self._queue.get()) is not None:
            version = hop.header.version
            if self.error(version) is not None:
                continue  # the version failed: its later buckets go nowhere
            try:
                self._send(hop)
            except Exception as e:  # recorded for the trainer, which fails the push naming it
                message = f"forwarding bucket {hop.header.index} of v{version} to {hop.url} failed: {e}"
                log.warning("%s", message)
                self.fail(version, message)
                continue
            self.count_forwarded(version)

    def _send(self, hop: _Hop) -> None:
        headers = {"Content-Type": "application/octet-stream"}
        if hop.authorization is not None:
            headers["Authorization"] = hop.authorization
        body = body_chunks(encode_prefix(hop.header), hop.payload)
        response = self._client.post(f"{hop.url}{BUCKET_ROUTE}", content=body, headers=headers, timeout=hop.timeout_s)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")


def _keep_recent(by_version: dict[int, Any]) -> None:
    """Drop the oldest entries beyond `VERSIONS_KEPT` (dicts keep insertion order)."""
    while len(by_version) > VERSIONS_KEPT:
        del by_version[next(iter(by_version))]
