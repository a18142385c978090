"""Client for SGLang's HTTP API, and for `weightsync serve`, which speaks it.

Maps an update's verbs onto SGLang's routes by the traits each transport's receiver declares
(`weightsync.transports.base.Receiver`), never by its name; the route of each verb per transport
is in docs/ENGINES.md. What only `weightsync serve` can do beyond an update (relays, shares,
rollback, digests of the served weights) is `engines/serve.py`'s client, handed out as
`SGLangEngine.extension` once `/weightsync/info` answered.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
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
from weightsync.engines.quantized_checkpoint import read_quantization
from weightsync.engines.serve import ServeClient
from weightsync.errors import AdapterNotLoadedError, EngineError
from weightsync.integrity import with_sent_names
from weightsync.manifest import BucketMeta, Manifest
from weightsync.protocol import (
    INFO_ROUTE,
    AbortRequest,
    BeginRequest,
    CommitRequest,
    ReceiveRequest,
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
    """One SGLang server (or `weightsync serve`, whose own verbs are `extension()`'s) at `url`.

    It keeps what it knows of the server (its connection, what it declared, the layout it
    remembers); what a push has done with it is the push's `EngineUpdate`."""

    transports: ClassVar[frozenset[str]] = frozenset(TRANSPORTS)
    lora_transports: ClassVar[frozenset[str]] = frozenset(TRANSPORTS)
    transports_note: str | None = None
    serve_client: ClassVar[type[ServeClient]] = ServeClient
    """The client `extension` hands out on `weightsync serve` (a test injects faults by its subclass)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 60.0,
                 num_ranks: int = 1, label: str | None = None, quantized_checkpoint: str | Path | None = None) -> None:
        """`quantized_checkpoint`: for a stock SGLang serving a quantized checkpoint (`--quantization`),
        its directory as this process can read it; the trainer then quantizes for it (docs/QUANTIZED.md)."""
        self.url = url.rstrip("/")
        self._quantization = read_quantization(quantized_checkpoint) if quantized_checkpoint is not None else None
        self.label = label or self.url
        self.num_ranks = num_ranks
        self.timeout_s = timeout_s
        self._http = JsonClient(self.url, api_key=api_key, timeout_s=timeout_s)  # the connection
        self._serve: ServeClient | None = None
        """The client of weightsync's own verbs, where the server has weightsync's routes (probed
        once, with the capabilities)."""
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

    def extension(self, timeout_s: float) -> ServeClient | None:
        """The client of what only `weightsync serve` can do (relays, shares, rollback, digests:
        `engines.serve.ServeClient`), where the server is one; None from a stock SGLang. Probes
        the server (within `timeout_s`) unless its capabilities were asked."""
        return self._serve if self._is_native(timeout_s) else None

    def serve(self, timeout_s: float | None = None) -> ServeClient:
        """`extension`, for a user's own calls (`engine.serve().digests()`); raises on a stock SGLang."""
        serve = self.extension(self.timeout_s if timeout_s is None else timeout_s)
        if serve is None:
            raise EngineError(self.label, "this is a stock SGLang server, without weightsync's routes: "
                              "relays, shares, rollback and digests need `weightsync serve`")
        return serve

    def digests(self, hf_names: Sequence[str] | None = None, *, timeout_s: float | None = None) -> dict[str, str]:
        """Digests of the served weights: `serve().digests` (weightsync serve only)."""
        return self.serve(timeout_s).digests(hf_names, timeout_s=timeout_s)

    def _is_native(self, timeout_s: float | None = None) -> bool:
        """True when the server has weightsync's routes; asked once (within `timeout_s`)."""
        if self._capabilities is None:
            response = self._http.request("GET", INFO_ROUTE, allow=(404,), timeout_s=timeout_s)
            if response.status_code == 404:
                self._capabilities = replace(stock_sglang(), quantization=self._quantization)
            else:
                self._capabilities = EngineCapabilities.from_dict(decode(response).get("capabilities") or {})
                self._serve = self.serve_client(self._http, url=self.url, label=self.label, timeout_s=self.timeout_s)
        return self._serve is not None

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
        if self._serve is not None and pause_id is not None:
            body["pause_id"] = pause_id
        self._http.post("/pause_generation", body, timeout_s=timeout_s)

    def resume(self, *, pause_id: str | None = None, timeout_s: float | None = None) -> None:
        """Continue generation (naming the pause it ends to `weightsync serve`)."""
        named = self._serve is not None and pause_id is not None
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

        version, link = update.version, update.link
        assert bucket.digest is not None, "buckets are hashed before they are sent"
        receiver = receiver_class(delivery.transport)
        if receiver.bytes_in_delivery:  # weightsync's frame route (begin required weightsync serve)
            assert self._serve is not None, "begin refuses a bytes-in-delivery transport without weightsync's routes"
            self._serve.post_bucket(bucket, delivery, update)
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
        assert self._serve is not None
        self._serve.open_session(manifest.version, link.timeout_s)

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


