"""Client for SGLang's HTTP API, and for `weightsync serve`, which speaks it.

Maps the weightsync protocol onto SGLang's routes (docs/ENGINES.md), by the traits
each transport's receiver declares (`weightsync.transports.base.Receiver`),
never by its name: a collective transport (broadcast) goes through SGLang's
group routes, one read at commit (disk) through its disk routes; the others
need weightsync's routes: bytes in the delivery (http) in a binary frame, any
other transport (shm) as its link and delivery, which the server's end of that
transport fetches the bytes by (`weightsync serve` takes a new transport
without a change here).

| protocol | broadcast                                   | disk                   | http / shm (weightsync serve) |
|----------|---------------------------------------------|------------------------|-------------------------------|
| connect  | /init_weights_update_group (blocks)         | -                      | -                             |
| begin    | /weightsync/begin*, /begin_weight_update    | /weightsync/begin*     | /weightsync/begin             |
| receive  | /update_weights_from_distributed, flattened | -                      | /weightsync/bucket or receive |
| commit   | /weightsync/commit*, /end_weight_update     | /update_weights_from_disk | /weightsync/commit         |
|          |                                             | (LoRA: /load_lora_adapter) |                              |
| abort    | /weightsync/abort*, /end_weight_update      | /weightsync/abort*     | /weightsync/abort             |

(* only where the server has the weightsync routes; a stock SGLang answers 404
on them, and then updates land in place, are not digest-checked by the
engine, and the push reports `verified=False` with the reason.)
A 404 on /begin_weight_update or /end_weight_update means an older SGLang that
needs no session.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar

from weightsync.dtypes import dtype_name
from weightsync.engines.base import (
    CLEANUP_TIMEOUT_S,
    Completion,
    Delivery,
    EngineCapabilities,
    EngineUpdate,
    Link,
    PausePolicy,
)
from weightsync.engines.json_client import JsonClient, decode, remote_error
from weightsync.errors import AdapterNotLoadedError, EngineError, SyncTimeoutError
from weightsync.formats.shares import Share
from weightsync.formats.wire import FrameHeader, body_chunks, encode_prefix
from weightsync.integrity import byte_view, with_sent_names
from weightsync.manifest import BucketMeta, Manifest
from weightsync.protocol import (
    BUCKET_ROUTE,
    INFO_ROUTE,
    AbortRequest,
    BeginRequest,
    CommitRequest,
    DigestsRequest,
    GroupRelayRequest,
    ReceiveRequest,
    RollbackRequest,
    WeightsyncRequest,
)
from weightsync.reports import Ack
from weightsync.transports import TRANSPORTS, receiver_class
from weightsync.transports.base import typed

log = logging.getLogger(__name__)


def _stock_routes(name: str) -> bool:
    """SGLang has routes of its own for transport `name`: group routes for a collective
    one, disk routes for one read at commit."""
    receiver = receiver_class(name)
    return receiver.collective or receiver.reads_at_commit


def stock_sglang() -> EngineCapabilities:
    """What a stock SGLang server (no weightsync routes) can do: its own broadcast and
    disk routes (LoRA: a PEFT directory on disk)."""
    return EngineCapabilities(
        unloads_adapters=True, supports_delta=False, transports=frozenset(filter(_stock_routes, TRANSPORTS)),
        lora_transports=frozenset(n for n in TRANSPORTS if receiver_class(n).reads_at_commit))


class SGLangEngine:
    """One SGLang server (or `weightsync serve`) at `url`.

    It keeps what it knows of the server (its connection, what it declared, the layout it
    remembers); what a push has done with it is the push's `EngineUpdate`."""

    transports: ClassVar[frozenset[str]] = frozenset(TRANSPORTS)
    lora_transports: ClassVar[frozenset[str]] = frozenset(TRANSPORTS)
    transports_note: str | None = None

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 60.0,
                 num_ranks: int = 1, label: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.label = label or self.url
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s
        self._http = JsonClient(self.url, api_key=api_key, timeout_s=timeout_s)  # the connection
        self._native = False
        """The server has weightsync's routes (probed once, with the capabilities)."""
        self._capabilities: EngineCapabilities | None = None
        """What the server declared (asked once)."""
        self._layout: str | None = None
        """The layout digest the engine named in its answer to the last begin: the engine
        remembers that layout across pushes (what it knows, not a push's state), so a begin of
        a manifest with this layout is sent by layout."""

    def _cleanup_timeout_s(self, timeout_s: float | None) -> float:
        return min(CLEANUP_TIMEOUT_S, self.timeout_s if timeout_s is None else timeout_s)

    # -- capabilities ------------------------------------------------------

    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        """What the server declares in `/weightsync/info` (a `weightsync serve`: it stages
        updates, applies deltas, reports digests), else what a stock SGLang can do: none
        of that (it could have been restarted from its checkpoint, so it cannot prove
        which version it holds); broadcast and disk, LoRA from disk."""
        self._is_native(timeout_s)
        assert self._capabilities is not None
        return replace(self._capabilities, num_ranks=self.num_ranks)

    def _is_native(self, timeout_s: float | None = None) -> bool:
        """True when the server has weightsync's routes; asked once (within `timeout_s`)."""
        if self._capabilities is None:
            response = self._http.request("GET", INFO_ROUTE, allow=(404,), timeout_s=timeout_s)
            if response.status_code == 404:
                self._capabilities = stock_sglang()
            else:
                self._capabilities = EngineCapabilities.from_dict(decode(response).get("capabilities") or {})
                self._native = True
        return self._native

    @property
    def num_requests(self) -> int:
        """HTTP requests this client has sent (a push's round trips are the difference)."""
        return self._http.num_requests

    def _require_native(self, what: str, timeout_s: float) -> None:
        if not self._is_native(timeout_s):
            raise EngineError(
                self.label,
                f"{what} needs weightsync's routes, which this SGLang server does not have; "
                "use transport='broadcast' or 'disk' (and LoRA via 'disk')",
            )

    # -- protocol ----------------------------------------------------------

    def connect(self, link: Link) -> None:
        if not receiver_class(link.transport).collective:
            return  # shm: `weightsync serve` maps the segment at its first bucket
        from weightsync.transports.broadcast import BroadcastLink  # transports load on first use

        group = typed(link, BroadcastLink)  # SGLang's group routes take a group's rendezvous
        self._http.post("/init_weights_update_group", {
            "master_address": group.master_address, "master_port": group.master_port,
            "rank_offset": group.rank_offset, "world_size": group.world_size,
            "group_name": group.group_name, "backend": group.backend,
        }, timeout_s=link.timeout_s)

    def disconnect(self, link: Link) -> None:
        if not receiver_class(link.transport).collective:
            return
        from weightsync.transports.broadcast import BroadcastLink

        group_name = typed(link, BroadcastLink).group_name
        try:
            self._http.post("/destroy_weights_update_group", {"group_name": group_name},
                            timeout_s=self._cleanup_timeout_s(link.timeout_s))
        except EngineError as e:
            log.warning("%s: destroying group %s: %s", self.label, group_name, e)

    def pause(self, policy: PausePolicy, *, pause_id: str | None = None, timeout_s: float | None = None) -> None:
        """POST /pause_generation; to `weightsync serve` named by `pause_id`, so that the resume
        that ends it cancels it should it reach the engine after that resume."""
        mode = policy.sglang_mode
        if mode is None:
            return
        body: dict[str, str] = {"mode": mode}
        if self._native and pause_id is not None:
            body["pause_id"] = pause_id
        self._http.post("/pause_generation", body, timeout_s=timeout_s)

    def resume(self, *, pause_id: str | None = None, timeout_s: float | None = None) -> None:
        """Continue generation (naming the pause it ends to `weightsync serve`)."""
        named = self._native and pause_id is not None
        self._http.post("/continue_generation", {"pause_id": pause_id} if named else {}, timeout_s=timeout_s)

    def begin(self, manifest: Manifest, update: EngineUpdate) -> str | None:
        link = update.link
        timeout_s = link.timeout_s
        note = None
        receiver = receiver_class(link.transport)
        if not _stock_routes(link.transport):
            self._require_native(f"transport {link.transport!r}", timeout_s)
        if manifest.is_adapter and not receiver.reads_at_commit:
            self._require_native(f"a LoRA adapter over {link.transport!r}", timeout_s)
        if self._is_native(timeout_s):
            note = self._begin(manifest, timeout_s).get("preempted")
        if receiver.collective:
            response = self._http.request("POST", "/begin_weight_update", json_body={"selector": "all"},
                                          allow=(404,), timeout_s=timeout_s)
            update.engine_session = response.status_code != 404
        return str(note) if note else None

    def _begin(self, manifest: Manifest, timeout_s: float) -> dict[str, Any]:
        """`/weightsync/begin`: by layout where the engine named this plan's layout in its
        answer to the last begin (`protocol.BeginRequest.by_layout`), whole otherwise, and
        whole again where it answers that it does not remember the layout (it restarted)."""
        by_layout = self._layout is not None and self._layout == manifest.layout_digest
        self._layout = None  # until this begin's answer names the layout the engine keeps
        while True:
            # whole: the manifest's JSON text as its buckets made it once, no dict per tensor per push
            response = self._http.request("POST", BeginRequest.ROUTE, timeout_s=timeout_s, allow=(409,),
                                          content=BeginRequest(manifest=manifest, by_layout=by_layout)
                                          .to_json_text().encode(),
                                          headers={"content-type": "application/json"})
            answer = decode(response)
            if response.status_code == 409:
                if by_layout and answer.get("unknown_layout"):
                    by_layout = False
                    continue
                raise remote_error(self._http.base_url, BeginRequest.ROUTE, response)
            layout = answer.get("layout")  # None from an engine that remembers no layouts
            self._layout = layout if isinstance(layout, str) else None
            return answer

    def receive(self, bucket: BucketMeta, delivery: Delivery, update: EngineUpdate) -> None:
        self._receive(bucket, delivery, update, ())

    def relay(self, bucket: BucketMeta, delivery: Delivery, update: EngineUpdate, forward: Sequence[str]) -> None:
        """`receive`, and the engine sends the bucket on along `forward` (`weightsync serve`,
        over http: `EngineCapabilities.relays`)."""
        if not receiver_class(delivery.transport).bytes_in_delivery:
            raise ValueError(f"{self.label}: buckets are relayed along URLs over http only, not "
                             f"{delivery.transport!r} (a group relays with relay_in_group)")
        self._receive(bucket, delivery, update, tuple(forward))

    def receive_share(self, share: Share, forward: Sequence[str], *, timeout_s: float) -> None:
        """One trainer rank's share of a bucket (`assembles_shares`); needs no `begin` here."""
        header = FrameHeader(version=share.version, index=share.index, nbytes=share.nbytes, digest=share.digest,
                             forward=tuple(forward), share_ranges=len(share.ranges),
                             share_digest=share.payload_digest())
        self._http.request("POST", BUCKET_ROUTE, content=body_chunks(encode_prefix(header), *share.payload()),
                           headers={"Content-Type": "application/octet-stream"}, timeout_s=timeout_s)

    def relay_in_group(self, manifest: Manifest, update: EngineUpdate, *, source: tuple[str, Link] | None,
                       forward: tuple[str, Link] | None) -> None:
        """`weightsync serve` takes the buckets of `manifest` from the rank before it in the
        broadcast group and sends them to the next (`/weightsync/relay`)."""
        from weightsync.transports.broadcast import BroadcastLink

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
            session, relay = self._open_session(manifest.version, link.timeout_s)
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

    def _open_session(self, version: int, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """The engine's open update session and relay state (`/weightsync/info?only=session`, without
        the model's parameter list); raises unless update `version` is still open there."""
        info = decode(self._http.request("GET", f"{INFO_ROUTE}?only=session", timeout_s=timeout_s))
        session = info.get("session") or {}
        if session.get("kind") != "weightsync" or session.get("version") != version:
            raise EngineError(self.label, f"update v{version} is no longer open on this engine (its open "
                              f"session: {session or None}); it expired, was replaced, or the engine restarted")
        return session, info.get("relay") or {}

    def _receive(self, bucket: BucketMeta, delivery: Delivery, update: EngineUpdate, forward: tuple[str, ...]) -> None:
        version, link = update.version, update.link
        assert bucket.digest is not None, "buckets are hashed before they are sent"
        receiver = receiver_class(delivery.transport)
        if receiver.bytes_in_delivery:
            prefix = encode_prefix(FrameHeader(version=version, index=bucket.index, nbytes=bucket.nbytes,
                                               digest=bucket.digest, forward=forward))
            payload = byte_view(delivery.data).numpy().data
            self._http.request("POST", BUCKET_ROUTE, content=body_chunks(prefix, payload),
                               headers={"Content-Type": "application/octet-stream"}, timeout_s=link.timeout_s)
        elif receiver.collective:
            self._http.post("/update_weights_from_distributed", self._broadcast_request(bucket, version, link),
                            timeout_s=link.timeout_s)
        elif not receiver.reads_at_commit:  # the server fetches the bytes (shm: from the segment)
            request = ReceiveRequest(version=version, index=bucket.index, digest=bucket.digest,
                                     link=link, delivery=delivery)
            self._send(request, link.timeout_s)
        else:
            raise ValueError(f"{self.label}: no per-bucket receive for transport {delivery.transport!r}")

    def ready(self, manifest: Manifest, update: EngineUpdate) -> None:
        link = update.link
        if not self._is_native(link.timeout_s):  # a stock SGLang holds no session: reachable is all it can say
            self._http.request("GET", "/health", timeout_s=link.timeout_s)
            return
        self._open_session(manifest.version, link.timeout_s)

    def commit(self, manifest: Manifest, update: EngineUpdate) -> Ack:
        """Where `update.pause_at_commit`, the commit request carries the pause mode: the
        engine pauses for the commit and resumes once it is answered (an answer, an HTTP
        error included, means it resumed)."""
        link = update.link
        if receiver_class(link.transport).reads_at_commit:
            return self._commit_disk(manifest, update)
        ack = None
        if self._is_native(link.timeout_s):
            pause = update.policy.sglang_mode if update.pause_at_commit else None
            body = self._send(CommitRequest(version=manifest.version, pause=pause, names_digest=True),
                              link.timeout_s)
            ack = with_sent_names(Ack.from_dict(body["ack"], engine=self.label), manifest.hf_names)
        self._end_session(update, link.timeout_s)
        return ack or self._unverified_ack(manifest)

    def abort(self, update: EngineUpdate, *, timeout_s: float | None = None) -> None:
        cleanup_s = self._cleanup_timeout_s(timeout_s)
        errors = []
        if self._is_native(cleanup_s):
            try:
                self._send(AbortRequest(version=update.version, owner=update.owner), cleanup_s)
            except EngineError as e:
                errors.append(e)
        self._end_session(update, cleanup_s)
        if errors:
            raise errors[0]

    def _end_session(self, update: EngineUpdate, timeout_s: float) -> None:
        """End SGLang's own update session where this push's begin opened it (once)."""
        if update.engine_session:
            update.engine_session = False
            self._http.request("POST", "/end_weight_update", json_body={}, allow=(404,), timeout_s=timeout_s)

    def rollback(self, version: int, *, owner: str | None = None, timeout_s: float | None = None) -> bool:
        """Undo the commit of `version` by the trainer `owner` (weightsync serve only; see `Rollbacker`)."""
        timeout_s = self._cleanup_timeout_s(timeout_s)
        self._require_native("rolling back a commit", timeout_s)
        body = self._send(RollbackRequest(version=version, owner=owner), timeout_s)
        return bool(body.get("rolled_back"))

    def unload_lora(self, lora_name: str, *, timeout_s: float | None = None) -> None:
        """Unload an adapter; SGLang waits for requests still using it. Raises
        `AdapterNotLoadedError` when no adapter of that name is loaded."""
        try:
            self._http.post("/unload_lora_adapter", {"lora_name": lora_name}, timeout_s=timeout_s)
        except EngineError as e:
            if e.status == 404 or "not loaded" in e.remote_message:
                raise AdapterNotLoadedError(self.label, e.remote_message, status=e.status) from e
            raise

    # -- generation --------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 lora_name: str | None = None, seed: int | None = None) -> list[Completion]:
        """Generate for a batch of token-id prompts, returning tokens and their logprobs.

        With `seed`, prompt i samples with seed `seed + i` (reproducible rollouts).
        """
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True}
        per_prompt: Any = params
        if seed is not None:
            per_prompt = [{**params, "seed": seed + i} for i in range(len(prompts))]
        body: dict[str, Any] = {"input_ids": [list(p) for p in prompts], "sampling_params": per_prompt,
                                "return_logprob": True}
        if lora_name is not None:
            body["lora_path"] = lora_name
        response = self._http.request("POST", "/generate", json_body=body)
        answers = response.json()
        return [_completion(a) for a in (answers if isinstance(answers, list) else [answers])]

    def weight_version(self) -> str:
        return str(self._http.get("/model_info").get("weight_version"))

    def digests(self, hf_names: Sequence[str] | None = None, *, timeout_s: float | None = None) -> dict[str, str]:
        """Digests of the served weights (weightsync serve only)."""
        self._require_native("reading weight digests", self.timeout_s if timeout_s is None else timeout_s)
        request = DigestsRequest(names=tuple(hf_names) if hf_names else None)
        return dict(self._send(request, timeout_s)["digests"])

    def instance(self, *, timeout_s: float | None = None) -> str | None:
        """The id the server process drew at start (weightsync serve; a stock SGLang: None)."""
        if not self._is_native(self.timeout_s if timeout_s is None else timeout_s):
            return None
        answer = decode(self._http.request("GET", INFO_ROUTE, timeout_s=timeout_s)).get("instance")
        return str(answer) if answer is not None else None

    def close(self) -> None:
        self._http.close()

    # -- internals ---------------------------------------------------------

    def _send(self, request: WeightsyncRequest, timeout_s: float | None) -> dict[str, Any]:
        """POST one of weightsync's own requests (`weightsync.protocol`) to its route."""
        return self._http.post(request.ROUTE, request.to_json(), timeout_s=timeout_s)

    def _broadcast_request(self, bucket: BucketMeta, version: int, link: Link) -> dict[str, Any]:
        from weightsync.transports.broadcast import BroadcastLink

        body: dict[str, Any] = {
            "names": [e.hf_name for e in bucket.entries],
            "dtypes": [dtype_name(e.stored_dtype) for e in bucket.entries],  # a sparse payload: uint8
            "shapes": [list(e.stored_shape) for e in bucket.entries],
            "group_name": typed(link, BroadcastLink).group_name,
            "load_format": "flattened_bucket",
            "flush_cache": False,  # flushed once, at commit
            "abort_all_requests": False,
            "weight_version": str(version),
        }
        if self._is_native(link.timeout_s):
            body.update(weightsync_version=version, weightsync_bucket=bucket.index, weightsync_digest=bucket.digest)
        return body

    def _commit_disk(self, manifest: Manifest, update: EngineUpdate) -> Ack:
        from weightsync.transports.disk import DiskLink

        link = update.link
        path = typed(link, DiskLink).version_dir(manifest.version)
        if manifest.is_adapter:
            assert manifest.lora_name is not None
            self._http.post("/load_lora_adapter", {"lora_name": manifest.lora_name, "lora_path": path},
                            timeout_s=link.timeout_s)
            if self._is_native(link.timeout_s):
                body = self._send(CommitRequest(version=manifest.version), link.timeout_s)
                return Ack.from_dict(body["ack"], engine=self.label)
            return self._unverified_ack(manifest)
        body = self._http.post("/update_weights_from_disk", {
            "model_path": path, "weight_version": str(manifest.version),
            # an update that flushes the cache while requests still run on it reports failure even
            # though the weights changed (docs/ENGINES.md): in_place keeps the cache
            "flush_cache": update.policy is not PausePolicy.IN_PLACE, "abort_all_requests": False,
        }, timeout_s=link.timeout_s)
        if "ack" in body:
            return Ack.from_dict(body["ack"], engine=self.label)
        return self._unverified_ack(manifest)

    def _unverified_ack(self, manifest: Manifest) -> Ack:
        """What a stock SGLang tells us: success, nothing checkable."""
        return Ack(engine=self.label, version=manifest.version, digests=(None,) * len(manifest.buckets),
                   loaded_names=frozenset(manifest.hf_names))


def _completion(answer: dict[str, Any]) -> Completion:
    meta = answer.get("meta_info", {})
    logprobs = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
    reason = meta.get("finish_reason") or {}
    return Completion(
        output_ids=list(answer.get("output_ids") or []),
        logprobs=logprobs,
        weight_version=str(meta.get("weight_version")),
        finish_reason=str(reason.get("type") if isinstance(reason, dict) else reason),
        text=str(answer.get("text", "")),
    )


