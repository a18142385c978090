"""LoRA routes (server started with --enable-lora): load from a PEFT directory or
from serialized tensors, unload once no request uses the adapter.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from weightsync.errors import IntegrityError, format_names
from weightsync.manifest import Manifest
from weightsync.server import ingest, lora
from weightsync.server.routes_common import (
    HTTPError,
    admin_json,
    answer,
    field_bool,
    field_str,
)
from weightsync.server.routes_updates import confined_dir
from weightsync.server.state import ServerState


def add_routes(app: FastAPI, state: ServerState) -> None:
    async def lora_json(request: Request) -> dict[str, Any]:
        body = await admin_json(request, state.config)
        if state.lora_store is None:
            raise HTTPError(400, "LoRA is not enabled; start the server with --enable-lora")
        return body

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = await lora_json(request)
        name = _lora_name(body)
        lora_path = field_str(body, "lora_path", required=True)
        assert lora_path is not None
        pinned = field_bool(body, "pinned", False)

        def work() -> JSONResponse:
            directory = confined_dir(lora_path, state.config.resolved_disk_root)
            config, tensors = ingest.read_peft_dir(directory)
            if _open_lora_session(state, name) is not None:
                return _stage_into_session(state, name, config, tensors)
            return _loaded_answer(state, name, _install(state, name, config, tensors, pinned=pinned))

        return await run_in_threadpool(work)

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(request: Request) -> JSONResponse:
        body = await lora_json(request)
        name = _lora_name(body)
        config = body.get("config_dict")
        if not isinstance(config, dict):
            raise HTTPError(400, "config_dict must be the adapter_config.json object")
        checksums = body.get("expected_checksums")
        if checksums is not None and not (isinstance(checksums, dict)
                                          and all(isinstance(v, str) for v in checksums.values())):
            raise HTTPError(400, "expected_checksums must map tensor names to sha256 hex strings")
        load_format = field_str(body, "load_format")
        pinned = field_bool(body, "pinned", False)

        def work() -> list[str]:
            named = ingest.decode_serialized(body.get("serialized_named_tensors"), load_format)
            tensors = dict(named)
            if len(tensors) != len(named):
                raise ValueError("a tensor name appears twice in serialized_named_tensors")
            _check_shapes_first(state, name, config, tensors)
            if checksums is not None:
                _verify_checksums(tensors, checksums)
            return _install(state, name, config, tensors, pinned=pinned)

        evicted = await run_in_threadpool(work)
        return _loaded_answer(state, name, evicted)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        body = await lora_json(request)
        name = _lora_name(body)
        store = state.lora_store
        assert store is not None
        await run_in_threadpool(lambda: store.unload(name, timeout_s=state.config.unload_timeout_s))
        return answer(f"LoRA adapter {name!r} unloaded", loaded_adapters=store.names())


def _lora_name(body: dict[str, Any]) -> str:
    name = field_str(body, "lora_name", required=True)
    assert name is not None
    if not name or name != name.strip():
        raise HTTPError(400, f"invalid lora_name {name!r}")
    return name


def _open_lora_session(state: ServerState, name: str) -> Manifest | None:
    """The manifest of the open lora-mode weightsync session that loads `name`, if any."""
    update = state.updater.session.open_update
    manifest = update.manifest if update is not None else None
    if manifest is not None and manifest.is_adapter and manifest.lora_name == name:
        return manifest
    return None


def _stage_into_session(state: ServerState, name: str, config: dict[str, Any],
                        tensors: dict[str, Any]) -> JSONResponse:
    """A PEFT directory for the open lora session (the disk transport): stage, do not load;
    /weightsync/commit loads it."""
    manifest = _open_lora_session(state, name)
    assert manifest is not None
    if dict(manifest.lora_config or {}) != config:
        raise ValueError(f"adapter_config.json of {name!r} differs from the lora_config given at begin")
    digests = state.receive_path.stage_as_buckets(manifest.version, tensors)
    return answer(f"LoRA adapter {name!r} staged into update v{manifest.version}; /weightsync/commit loads it",
                  digests=digests)


def _check_shapes_first(state: ServerState, name: str, config: dict[str, Any], tensors: dict[str, Any]) -> None:
    """Shapes against the model before any hashing (a hostile shape must not cost memory)."""
    from weightsync.manifest import TensorMeta

    lora.check_adapter(state.runner.model, lora.parse_config(config),
                       {n: TensorMeta.of(n, t) for n, t in tensors.items()}, lora_name=name)


def _verify_checksums(tensors: dict[str, Any], checksums: dict[str, str]) -> None:
    """expected_checksums must name exactly the sent tensors, each with its sha256."""
    unknown = set(checksums) - set(tensors)
    unchecked = set(tensors) - set(checksums)
    if unknown or unchecked:
        raise IntegrityError(f"expected_checksums do not match the tensors: for unknown {format_names(unknown)}, "
                             f"missing for {format_names(unchecked)}")
    bad = [n for n, t in tensors.items() if ingest.sha256_hex(t) != checksums[n].lower()]
    if bad:
        raise IntegrityError(f"sha256 mismatch for {format_names(bad)}; tensors were corrupted in transit")


def _install(state: ServerState, name: str, config: dict[str, Any], tensors: dict[str, Any], *,
             pinned: bool) -> list[str]:
    assert state.lora_store is not None
    if state.lora_store.is_loaded(name):
        from weightsync.server.errors import ConflictError

        raise ConflictError(f"LoRA adapter {name!r} is already loaded; unload it first")
    adapter = lora.build_adapter(state.runner.model, name, config, tensors)
    return [a.name for a in state.lora_store.add(adapter, pinned=pinned)]


def _loaded_answer(state: ServerState, name: str, evicted: list[str]) -> JSONResponse:
    assert state.lora_store is not None
    return answer(f"LoRA adapter {name!r} loaded", loaded_adapters=state.lora_store.names(), evicted=evicted)
