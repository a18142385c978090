"""Client of what only `weightsync serve` can do, beyond SGLang's API: relays (`Relayer`),
shares (`ShareReceiver`), rollback (`Rollbacker`) and digests of the served weights
(`DigestReader`), over weightsync's own routes (docs/PROTOCOL.md).

`SGLangEngine` hands it out (`SGLangEngine.extension`) once its handshake found
`weightsync serve` (`/weightsync/info` answered); a stock SGLang has none of these routes and
gets none. It shares the engine client's connection and keeps nothing of a push: what a push
has done with the engine is the push's `EngineUpdate`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from weightsync.engines.base import CLEANUP_TIMEOUT_S, Delivery, EngineUpdate, Link
from weightsync.engines.json_client import JsonClient, decode
from weightsync.errors import EngineError, SyncTimeoutError
from weightsync.formats.shares import Share
from weightsync.formats.wire import FrameHeader, body_chunks, encode_prefix
from weightsync.integrity import byte_view
from weightsync.manifest import BucketMeta, Manifest
from weightsync.protocol import (
    BUCKET_ROUTE,
    INFO_ROUTE,
    DigestsRequest,
    GroupRelayRequest,
    RollbackRequest,
    WeightsyncRequest,
)
from weightsync.transports import receiver_class
from weightsync.transports.base import typed


class ServeClient:
    """The verbs of one `weightsync serve` at `url` beyond SGLang's API, over the connection
    `http` of the `SGLangEngine` that found it."""

    def __init__(self, http: JsonClient, *, url: str, label: str, timeout_s: float) -> None:
        self._http = http
        """The engine client's connection (shared, not owned: the engine client closes it)."""
        self._url = url
        self.label = label
        self.timeout_s = timeout_s
        """Bounds the calls a user makes directly (digests, instance), as the engine client's."""

    @property
    def url(self) -> str:
        return self._url

    # -- buckets and shares --------------------------------------------------

    def post_bucket(self, bucket: BucketMeta, delivery: Delivery, update: EngineUpdate,
                    forward: Sequence[str] = ()) -> None:
        """One bucket whose bytes travel in `delivery` (http), in a binary frame to
        `/weightsync/bucket`; the engine sends it on along `forward` (URLs, in order)."""
        assert bucket.digest is not None, "buckets are hashed before they are sent"
        prefix = encode_prefix(FrameHeader(version=update.version, index=bucket.index, nbytes=bucket.nbytes,
                                           digest=bucket.digest, forward=tuple(forward)))
        payload = byte_view(delivery.data).numpy().data
        self._http.request("POST", BUCKET_ROUTE, content=body_chunks(prefix, payload),
                           headers={"Content-Type": "application/octet-stream"}, timeout_s=update.link.timeout_s)

    def relay(self, bucket: BucketMeta, delivery: Delivery, update: EngineUpdate, forward: Sequence[str]) -> None:
        """`Engine.receive`, and the engine sends the bucket on along `forward` (over http:
        `EngineCapabilities.relays`)."""
        if not receiver_class(delivery.transport).bytes_in_delivery:
            raise ValueError(f"{self.label}: buckets are relayed along URLs over http only, not "
                             f"{delivery.transport!r} (a group relays with relay_in_group)")
        self.post_bucket(bucket, delivery, update, forward)

    def receive_share(self, share: Share, forward: Sequence[str], *, timeout_s: float) -> None:
        """One trainer rank's share of a bucket (`assembles_shares`); needs no `begin` here."""
        header = FrameHeader(version=share.version, index=share.index, nbytes=share.nbytes, digest=share.digest,
                             forward=tuple(forward), share_ranges=len(share.ranges),
                             share_digest=share.payload_digest())
        self._http.request("POST", BUCKET_ROUTE, content=body_chunks(encode_prefix(header), *share.payload()),
                           headers={"Content-Type": "application/octet-stream"}, timeout_s=timeout_s)

    # -- relays ----------------------------------------------------------------

    def relay_in_group(self, manifest: Manifest, update: EngineUpdate, *, source: tuple[str, Link] | None,
                       forward: tuple[str, Link] | None) -> None:
        """The engine takes the buckets of `manifest` from the rank before it in the
        broadcast group and sends them to the next (`/weightsync/relay`)."""
        from weightsync.transports.broadcast import BroadcastLink  # transports load on first use

        link = update.link
        group = typed(link, BroadcastLink)
        source_label, source_rank = (("the trainer", 0) if source is None
                                     else (source[0], typed(source[1], BroadcastLink).rank_offset))
        request = GroupRelayRequest(
            version=manifest.version, group_name=group.group_name, source_rank=source_rank, source_label=source_label,
            forward_rank=None if forward is None else typed(forward[1], BroadcastLink).rank_offset,
            forward_label=None if forward is None else forward[0])
        self._send(request, link.timeout_s)

    def wait_relayed(self, manifest: Manifest, update: EngineUpdate) -> None:
        """Return once every bucket of `manifest` is staged here (they come from the engine
        before this one in the relay) and, relayed in a group, sent on to the next engine;
        raise, naming this engine and the hop, where the relay into or out of here failed,
        or where buckets are still missing after timeout_s."""
        link, forwards = update.link, update.forwards
        want = set(range(len(manifest.buckets)))
        deadline = time.monotonic() + link.timeout_s
        backoff = 0.005
        while True:
            session, relay = self.open_session(manifest.version, link.timeout_s)
            error = (relay.get("errors") or {}).get(str(manifest.version))
            if error:
                raise EngineError(self.label, f"relay of v{manifest.version}: {error}")
            missing = want - set(session.get("buckets_received") or ())
            forwarded = int((relay.get("forwarded") or {}).get(str(manifest.version), 0))
            if not missing and (not forwards or forwarded >= len(want)):
                return
            if time.monotonic() >= deadline:
                if not missing:
                    raise SyncTimeoutError(f"{self.label}: {len(want) - forwarded} bucket(s) of v{manifest.version} "
                                           f"not sent on to the next engine within {link.timeout_s:.0f}s")
                raise SyncTimeoutError(f"{self.label}: bucket(s) {sorted(missing)[:8]} of v{manifest.version} did "
                                       f"not arrive through the relay within {link.timeout_s:.0f}s (an engine "
                                       "before this one stopped forwarding)")
            time.sleep(backoff)
            backoff = min(2 * backoff, 0.02)  # a cheap view; the last buckets arrive a hop apart

    def relay_error(self, version: int, *, timeout_s: float) -> str | None:
        info = decode(self._http.request("GET", f"{INFO_ROUTE}?only=session", timeout_s=timeout_s))
        error = ((info.get("relay") or {}).get("errors") or {}).get(str(version))
        return None if error is None else str(error)

    def open_session(self, version: int, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """The engine's open update session and relay state (`/weightsync/info?only=session`, without
        the model's parameter list); raises unless update `version` is still open there."""
        info = decode(self._http.request("GET", f"{INFO_ROUTE}?only=session", timeout_s=timeout_s))
        session = info.get("session") or {}
        if session.get("kind") != "weightsync" or session.get("version") != version:
            raise EngineError(self.label, f"update v{version} is no longer open on this engine (its open "
                              f"session: {session or None}); it expired, was replaced, or the engine restarted")
        return session, info.get("relay") or {}

    # -- after a commit ----------------------------------------------------------

    def rollback(self, version: int, *, owner: str | None = None, timeout_s: float | None = None) -> bool:
        """Undo the commit of `version` by the trainer `owner` (see `Rollbacker`)."""
        timeout_s = min(CLEANUP_TIMEOUT_S, self.timeout_s if timeout_s is None else timeout_s)
        body = self._send(RollbackRequest(version=version, owner=owner), timeout_s)
        return bool(body.get("rolled_back"))

    def digests(self, hf_names: Sequence[str] | None = None, *, timeout_s: float | None = None) -> dict[str, str]:
        """Digests of the served weights."""
        request = DigestsRequest(names=tuple(hf_names) if hf_names else None)
        return dict(self._send(request, timeout_s)["digests"])

    def instance(self, *, timeout_s: float | None = None) -> str | None:
        """The id the server process drew at start."""
        answer = decode(self._http.request("GET", INFO_ROUTE, timeout_s=timeout_s)).get("instance")
        return str(answer) if answer is not None else None

    def _send(self, request: WeightsyncRequest, timeout_s: float | None) -> dict[str, Any]:
        """POST one of weightsync's own requests (`weightsync.protocol`) to its route."""
        return self._http.post(request.ROUTE, request.to_json(), timeout_s=timeout_s)
