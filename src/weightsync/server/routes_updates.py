"""Weight-update routes: SGLang's contract and weightsync's `/weightsync/*` routes.

Every route parses its wire format and hands what it carries on: a bucket's bytes to
the receive path (`state.receive_path`, the one way bytes reach the update session),
named tensors (ingest) to the updater, which stages them and commits atomically. See
docs/PROTOCOL.md for the contract; blocking work (unpickling, digests, collectives,
disk reads) runs in worker threads.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from weightsync.bucketing import pack_one
from weightsync.dtypes import dtype_name
from weightsync.engines.base import EngineCapabilities
from weightsync.errors import SyncTimeoutError, UnknownLayoutError
from weightsync.formats.groups import join_group
from weightsync.formats.shares import RANGE_BYTES
from weightsync.formats.version_dir import MANIFEST_FILE, confine, read_manifest
from weightsync.formats.wire import MAX_HEADER_BYTES, FrameHeader
from weightsync.links import Delivery
from weightsync.manifest import TensorEntry, TensorMeta
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
    ShmBucketRequest,
)
from weightsync.receive.receive_path import host_buffer
from weightsync.reports import Ack
from weightsync.server import ingest
from weightsync.server.errors import ConflictError
from weightsync.server.experts import read_checkpoint_version
from weightsync.server.group_relay import GroupRelay
from weightsync.server.relay import RelayError
from weightsync.server.routes_common import (
    HTTPError,
    admin_json,
    answer,
    field_bool,
    field_int,
    field_str,
    read_frame,
    read_json,
    require_admin,
    weight_version_field,
)
from weightsync.server.scheduler import PAUSE_MODES
from weightsync.server.state import JoinedGroup, ServerState
from weightsync.server.updates import StageResult
from weightsync.transports import TRANSPORTS
from weightsync.transports.shm import ShmLink, ShmTransport

FRAME_OVERHEAD_BYTES = 8 + MAX_HEADER_BYTES


def add_routes(app: FastAPI, state: ServerState) -> None:
    _add_generation_control(app, state)
    _add_sglang_updates(app, state)
    _add_group_routes(app, state)
    if state.config.weightsync_routes:
        _add_weightsync_routes(app, state)


def _staged_answer(state: ServerState, result: StageResult, **extra: Any) -> JSONResponse:
    """SGLang's answer; with weightsync's routes on, it also carries the ack of an applied update."""
    if result.ack is not None and state.config.weightsync_routes:
        extra["ack"] = result.ack.to_wire()
    return answer(result.message, num_paused_requests=0, **extra)


def _maybe_abort_all(state: ServerState, body: dict[str, Any], default: bool = False) -> None:
    if field_bool(body, "abort_all_requests", default):
        state.scheduler.abort_all("aborted for a weight update (abort_all_requests)")


def confined_dir(path: str, root: Path) -> Path:
    """`path` resolved under `root`, with every entry inside it too (no symlink escapes)."""
    real = confine(path, root)
    if not real.is_dir():
        raise FileNotFoundError(f"{path!r} is not a directory")
    for entry in real.iterdir():
        confine(entry, root)
    return real


def _serving_dtypes(metas: Iterable[TensorMeta]) -> tuple[torch.dtype | None, dict[str, torch.dtype]]:
    """The dtype floating weights are served in (the one holding most of their bytes: trainers
    cast to it), and the floating tensors held in another (a bf16 GLM-4.5's float32 router
    bias, which transformers keeps in float32): name -> its dtype."""
    floating = [m for m in metas if m.dtype.is_floating_point]
    if not floating:
        return None, {}
    held: Counter[torch.dtype] = Counter()
    for m in floating:
        held[m.dtype] += m.nbytes
    dtype = held.most_common(1)[0][0]
    return dtype, {m.hf_name: m.dtype for m in floating if m.dtype != dtype}


DEFAULT_RELAY_TIMEOUT_S = 60.0
"""How long one forward (or, in a group, one receive) of a relayed bucket may take when
the manifest names no timeout."""


def _pause_mode(mode: str | None) -> str:
    """`mode` if it is one of SGLang's pause modes; a 400 naming them otherwise."""
    if mode not in PAUSE_MODES:
        raise HTTPError(400, f"unknown pause mode {mode!r}; one of {list(PAUSE_MODES)}")
    return mode


def _add_generation_control(app: FastAPI, state: ServerState) -> None:
    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        mode = _pause_mode(field_str(body, "mode", default="abort"))
        # weightsync's client names each pause, and its resume names the same: a pause that
        # reaches the engine after its resume (the trainer gave up waiting) is not applied
        pause_id = field_str(body, "pause_id", default=None)
        affected = await run_in_threadpool(functools.partial(state.scheduler.pause, mode, pause_id=pause_id))
        return answer(f"generation paused ({mode}); {affected} request(s) affected", num_paused_requests=affected)

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        state.scheduler.resume(pause_id=field_str(body, "pause_id", default=None))
        return answer("generation continued")


def _add_sglang_updates(app: FastAPI, state: ServerState) -> None:
    updater = state.updater

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> JSONResponse:
        await admin_json(request, state.config)
        return answer(await run_in_threadpool(updater.begin_sglang))

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request) -> JSONResponse:
        await admin_json(request, state.config)
        return _staged_answer(state, await run_in_threadpool(updater.end_sglang))

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        model_path = field_str(body, "model_path", required=True)
        assert model_path is not None
        label = weight_version_field(body)

        def work() -> StageResult:
            directory = confined_dir(model_path, state.config.resolved_disk_root)
            _maybe_abort_all(state, body)
            if (directory / MANIFEST_FILE).is_file():
                if updater.experts.names_experts(read_manifest(directory).hf_names):  # a stock SGLang's push
                    return updater.stage_named(read_checkpoint_version(directory), label=label, full=True)
                return updater.apply_version_dir(directory, label=label)
            return updater.stage_named(ingest.read_hf_checkpoint(directory), label=label, full=True)

        result = await run_in_threadpool(work)
        if result.ack is not None:  # served now: /model_info names it, as SGLang does
            state.model_path = model_path
        return _staged_answer(state, result)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        label = weight_version_field(body)
        load_format = field_str(body, "load_format")

        def work() -> StageResult:
            named = ingest.decode_serialized(body.get("serialized_named_tensors"), load_format)
            _maybe_abort_all(state, body)
            return updater.stage_named(named, label=label)

        return _staged_answer(state, await run_in_threadpool(work))

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        label = weight_version_field(body, "new_version")
        if label is None:
            raise HTTPError(400, "missing required field 'new_version'")
        _maybe_abort_all(state, body, default=True)
        await run_in_threadpool(updater.weights.set_label, label)
        return answer(f"Weight version updated to {label}", new_version=label)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)  # SGLang: AuthLevel.ADMIN_OPTIONAL
        name = field_str(body, "name", required=True)
        assert name is not None
        truncate = field_int(body, "truncate_size", default=100)
        values, digest_hex = await run_in_threadpool(updater.weights.weights_by_name, name, truncate or 0)
        # SGLang answers with the bare list; the digest of the whole tensor rides in a header.
        return JSONResponse(values, headers={"X-Weightsync-Digest": digest_hex})


def _add_group_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        address = field_str(body, "master_address", required=True)
        port = field_int(body, "master_port", required=True)
        world_size = field_int(body, "world_size", required=True)
        rank_offset = field_int(body, "rank_offset", default=1)
        group_name = field_str(body, "group_name", default="weight_update_group")
        backend = field_str(body, "backend", default="nccl")
        assert address and port is not None and world_size is not None and rank_offset is not None and group_name
        if backend == "nccl" and not torch.cuda.is_available():
            raise HTTPError(400, "backend 'nccl' needs CUDA and this engine runs on CPU; use backend 'gloo'")
        if backend not in ("gloo", "nccl"):
            raise HTTPError(400, f"unknown backend {backend!r}; use 'gloo' (CPU) or 'nccl'")
        with state.groups_lock:
            if group_name in state.groups:
                raise ConflictError(f"group {group_name!r} already exists; destroy it first")
        group = await run_in_threadpool(
            lambda: join_group(master_address=address, master_port=port, rank=rank_offset, world_size=world_size,
                               group_name=group_name, backend=backend, timeout_s=state.config.group_timeout_s))
        with state.groups_lock:
            state.groups[group_name] = JoinedGroup(group)
        return answer(f"joined weight update group {group_name!r} as rank {rank_offset} of {world_size}")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        group_name = field_str(body, "group_name", default="weight_update_group")
        with state.groups_lock:
            joined = state.groups.pop(str(group_name), None)
        if joined is None:
            raise HTTPError(400, f"no weight update group named {group_name!r}")
        await run_in_threadpool(joined.group.destroy)
        return answer(f"destroyed weight update group {group_name!r}")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        group_name = field_str(body, "group_name", default="weight_update_group")
        with state.groups_lock:
            joined = state.groups.get(str(group_name))
        if joined is None:
            raise HTTPError(400, f"no weight update group named {group_name!r}; call /init_weights_update_group")
        load_format = field_str(body, "load_format")
        if load_format not in (None, "flattened_bucket"):
            raise HTTPError(400, f"unknown load_format {load_format!r}; use null or 'flattened_bucket'")
        entries = ingest.parse_broadcast_spec(body.get("names"), body.get("dtypes"), body.get("shapes"))
        result = await run_in_threadpool(_receive_distributed, state, joined, entries, body, load_format)
        return _staged_answer(state, result)


def _receive_distributed(state: ServerState, joined: JoinedGroup, entries: list[TensorEntry],
                         body: dict[str, Any], load_format: str | None) -> StageResult:
    bucket_index = field_int(body, "weightsync_bucket")
    with joined.lock:
        try:
            named, buffer = ingest.receive_broadcast(
                joined.group, entries, flattened=load_format == "flattened_bucket",
                timeout_s=state.config.group_timeout_s, alloc=state.receive_path.buffer)
        except (RuntimeError, SyncTimeoutError):  # the group broke (a trainer died) or stalled
            if bucket_index is not None:  # that trainer's weightsync update cannot complete
                state.updater.abort(field_int(body, "weightsync_version"))
            raise
    _maybe_abort_all(state, body)
    if bucket_index is None:
        return state.updater.stage_named(named, label=weight_version_field(body))
    version = field_int(body, "weightsync_version", required=True)
    assert version is not None
    packed = buffer if buffer is not None else _pack_listed(state, version, bucket_index, named)
    digest_hex = state.receive_path.stage(version=version, index=bucket_index, buffer=packed,
                                          digest_hex=field_str(body, "weightsync_digest"))
    return StageResult(f"bucket {bucket_index} of v{version} staged (digest {digest_hex})")


def _pack_listed(state: ServerState, version: int, index: int, named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Tensors received one broadcast each, packed into their bucket's layout."""
    bucket = state.updater.session.bucket(version, index)
    if [n for n, _ in named] != list(bucket.hf_names):
        raise ValueError(f"bucket {index}: names listed differ from the manifest's bucket (same names, same order)")
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
    for entry, (_, tensor) in zip(bucket.entries, named, strict=True):
        pack_one(buffer, entry, tensor)
    return buffer


def _add_weightsync_routes(app: FastAPI, state: ServerState) -> None:
    updater = state.updater

    @app.get(INFO_ROUTE)
    async def info(only: str | None = None) -> dict[str, Any]:
        if only == "session":  # what a trainer polls during a push: no parameter list, no capabilities
            return {"success": True, "message": "", "session": updater.session_info(), "relay": _relay_info(state)}
        if only is not None:
            raise HTTPError(400, f"unknown view only={only!r}; the one view is only=session")
        lora_enabled = state.lora_store is not None
        dtype, kept = _serving_dtypes(updater.weights.metas.values())
        quantized = updater.quantized  # pushes send its weights quantized: dequantized at a staged commit
        capabilities = EngineCapabilities(
            num_ranks=1, dtype=dtype, kept_dtypes=kept, stages_updates=True,
            pauses_at_commit=True, supports_delta=True, supports_sparse=quantized is None, adopts_shm=True,
            reads_digests=True, unloads_adapters=lora_enabled, rolls_back=True, relays=True, assembles_shares=True,
            streams_commit=quantized is None, expert_layout="fused",
            transports=frozenset(TRANSPORTS), lora_transports=frozenset(TRANSPORTS if lora_enabled else ()),
            quantization=quantized.quantization if quantized is not None else None,
            fused_groups=quantized.fused_groups if quantized is not None else ())
        return {
            "success": True,
            "message": "",
            "weightsync": 1,
            "instance": state.instance,
            "weight_version": updater.version,
            "label": updater.weights.label,
            "capabilities": capabilities.to_dict(),
            "dirty": updater.weights.coverage.dirty,  # SGLang-shaped requests applied part of an update
            "partial_update": updater.weights.coverage.info(),
            "torn": updater.weights.coverage.unservable(),
            "loading": updater.loading,  # a streamed update loading: no step runs until its commit
            "refusing": updater.weights.coverage.refusal(),  # a streamed update failed midway
            "transports": sorted(capabilities.transports),
            "lora_transports": sorted(capabilities.lora_transports),
            "loaded_loras": state.lora_store.names() if state.lora_store is not None else [],
            "paused": state.scheduler.paused,
            "running_requests": state.scheduler.num_running,
            "waiting_requests": state.scheduler.num_waiting,
            "session": updater.session_info(),
            "layouts": updater.layouts.info(),
            "relay": _relay_info(state),
            "params": {n: {"dtype": str(m.dtype).removeprefix("torch."), "shape": list(m.shape)}
                       for n, m in updater.weights.metas.items()},
            "dtype": None if dtype is None else dtype_name(dtype),
        }

    @app.post(DigestsRequest.ROUTE)
    async def digests(request: Request) -> JSONResponse:
        names = DigestsRequest.from_json(await read_json(request, state.config.max_json_bytes)).names
        version, result = await run_in_threadpool(updater.weights.digests, names)
        return answer("", weight_version=version, digests=result)

    @app.post(BeginRequest.ROUTE)
    async def begin(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        try:
            begun = BeginRequest.from_json(body, known=updater.last_manifest, layouts=updater.layouts.get)
        except UnknownLayoutError as e:  # the trainer sends the manifest whole
            return answer(str(e), status=409, success=False, unknown_layout=e.layout)
        manifest = begun.manifest

        def work() -> tuple[str | None, str]:
            preempted = updater.begin(manifest)  # the dry run, by layout or not
            return preempted, updater.layouts.remember(manifest, by_layout=begun.by_layout)

        preempted, layout = await run_in_threadpool(work)
        return answer(f"update v{manifest.version} begun ({len(manifest.buckets)} bucket(s))", preempted=preempted,
                      layout=layout)

    @app.post(BUCKET_ROUTE)
    async def bucket(request: Request) -> JSONResponse:
        require_admin(request, state.config.admin_api_key)
        update = updater.session.open_update
        if update is None:
            raise ConflictError("no weightsync update session is open; call /weightsync/begin")
        buckets = update.manifest.buckets
        largest = max((b.nbytes + RANGE_BYTES * (len(b.entries) + 1) for b in buckets), default=0)  # a share's table
        def alloc(header: FrameHeader) -> torch.Tensor:  # a share is copied into its bucket: a buffer of its own
            return host_buffer(header.nbytes) if header.is_share else receive.buffer(header.nbytes, header.version)

        receive = state.receive_path
        try:
            header, data = await read_frame(request, largest + FRAME_OVERHEAD_BYTES, alloc)
        except ClientDisconnect:  # the trainer vanished mid-body: its update cannot complete
            updater.abort(update.version, owner=update.owner)
            raise
        payload = data.numpy().data.cast("B")

        def forward(header: FrameHeader, payload: memoryview) -> None:
            try:
                state.relay.forward(header, payload, authorization=request.headers.get("authorization"),
                                    timeout_s=update.manifest.timeout_s or DEFAULT_RELAY_TIMEOUT_S)
            except RelayError as e:
                raise HTTPError(504, str(e)) from None

        def work() -> str | None:
            if header.is_share:
                return _stage_share(state, header, payload, forward)
            digest_hex = receive.stage(version=header.version, index=header.index, buffer=data,
                                       digest_hex=header.digest)
            if header.forward:  # checked and staged here: now the next engine of the relay
                forward(header, payload)
            return digest_hex

        digest_hex = await run_in_threadpool(work)
        return answer("bucket staged" if digest_hex else "share taken", digest=digest_hex)

    @app.post(GroupRelayRequest.ROUTE)
    async def group_relay(request: Request) -> JSONResponse:
        body = GroupRelayRequest.from_json(await admin_json(request, state.config))
        with state.groups_lock:
            joined = state.groups.get(body.group_name)
        if joined is None:
            raise HTTPError(400, f"no weight update group named {body.group_name!r}; call /init_weights_update_group")
        update = updater.session.open_update
        if update is None or update.version != body.version:
            raise ConflictError(f"update v{body.version} is not open here; call /weightsync/begin first")
        GroupRelay(body, group=joined.group, updater=updater, record=state.relay,
                   num_buckets=len(update.manifest.buckets),
                   timeout_s=update.manifest.timeout_s or DEFAULT_RELAY_TIMEOUT_S).start()
        forward = f", then to rank {body.forward_rank}" if body.forward_rank is not None else ""
        return answer(f"relaying v{body.version}: from rank {body.source_rank}{forward}")

    @app.post(ShmBucketRequest.ROUTE)
    async def shm_bucket(request: Request) -> JSONResponse:
        body = ShmBucketRequest.from_json(await admin_json(request, state.config))
        digest_hex = await run_in_threadpool(_stage_from_shm, state, body)
        return answer("bucket staged", digest=digest_hex)

    @app.post(ReceiveRequest.ROUTE)
    async def receive(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        digest_hex = await run_in_threadpool(_stage_fetched, state, body)
        return answer("bucket staged", digest=digest_hex)

    @app.post(CommitRequest.ROUTE)
    async def commit(request: Request) -> JSONResponse:
        body = CommitRequest.from_json(await admin_json(request, state.config))
        if body.pause is not None:
            _pause_mode(body.pause)
        ack = await run_in_threadpool(_commit, state, body)
        return answer(f"v{body.version} committed", ack=ack.to_wire(names_digest=body.names_digest))

    @app.post(AbortRequest.ROUTE)
    async def abort(request: Request) -> JSONResponse:
        body = AbortRequest.from_json(await admin_json(request, state.config))
        dropped = updater.abort(body.version, owner=body.owner)
        state.assembly.drop(body.version)
        return answer(f"update v{body.version} aborted" if dropped else "nothing to abort", aborted=dropped)

    @app.post(RollbackRequest.ROUTE)
    async def rollback(request: Request) -> JSONResponse:
        body = RollbackRequest.from_json(await admin_json(request, state.config))
        undone = await run_in_threadpool(updater.rollback, body.version, owner=body.owner)
        message = f"v{body.version} rolled back" if undone else f"v{body.version} is not served: nothing to roll back"
        return answer(message, rolled_back=undone, weight_version=updater.version)


def _relay_info(state: ServerState) -> dict[str, Any]:
    """What this engine forwarded of each recent relayed update (version -> buckets), and
    why forwarding stopped where it did."""
    return {"forwarded": state.relay.forwarded_counts(), "errors": state.relay.errors()}


def _commit(state: ServerState, request: CommitRequest) -> Ack:
    """Commit, holding generation in the request's pause mode for the commit alone (what
    /pause_generation, the commit and /continue_generation do, in one round trip). The
    ack names the shm slots the served weights now live in (`Ack.held_slots`)."""
    held_slots = state.receive_path.held_slots
    if request.pause is None:
        return state.updater.commit(request.version, held_slots=held_slots)
    state.scheduler.pause(request.pause)
    try:
        return state.updater.commit(request.version, held_slots=held_slots)
    finally:
        state.scheduler.resume()


def _stage_share(state: ServerState, header: FrameHeader, payload: memoryview,
                 forward: Callable[[FrameHeader, memoryview], None]) -> str | None:
    """One trainer rank's share of a bucket (`weightsync.formats.shares`): checked, forwarded where
    the push is relayed, copied into the bucket; the whole bucket is staged (its digest
    checked against the whole-bucket digest) once its shares tile it. Returns its digest
    then, else None."""
    bucket = state.updater.session.bucket(header.version, header.index)  # an open update, a valid index
    whole = state.assembly.add(version=header.version, index=header.index, nbytes=bucket.nbytes,
                               whole_digest=header.digest, num_ranges=header.share_ranges,
                               share_digest=header.share_digest, payload=payload,
                               alloc=lambda nbytes: state.receive_path.buffer(nbytes, header.version))
    if header.forward:  # this share is what the trainer rank sent: the next engine checks it as this one did
        forward(header, payload)
    if whole is None:
        return None
    return state.receive_path.stage(version=header.version, index=header.index, buffer=whole,
                                    digest_hex=header.digest)


def _stage_from_shm(state: ServerState, request: ShmBucketRequest) -> str:
    """`/weightsync/shm_bucket`: the bucket in a slot of the named segment, mapped at its
    first bucket, then kept."""
    link = ShmLink(transport=ShmTransport.name, shm_name=request.shm_name, slot_bytes=request.slot_bytes,
                   num_slots=request.num_slots)
    return state.receive_path.receive(link, version=request.version, index=request.index,
                                      delivery=Delivery(transport=link.transport, slot=request.slot),
                                      digest_hex=request.digest)


def _stage_fetched(state: ServerState, body: dict[str, Any]) -> str:
    """`/weightsync/receive`: the bucket fetched by the engine end of the link's transport,
    which joins the link's session at its first bucket."""
    request = ReceiveRequest.from_json(body)
    link = request.link
    receiver = state.receive_path.receiver(link.transport)
    if receiver.bytes_in_delivery or receiver.reads_at_commit or receiver.collective:
        raise HTTPError(400, f"transport {link.transport!r} does not deliver through {ReceiveRequest.ROUTE}: "
                        "its bytes come in /weightsync/bucket frames, SGLang's group routes or a version directory")
    return state.receive_path.receive(link, version=request.version, index=request.index,
                                      delivery=request.delivery, digest_hex=request.digest)
