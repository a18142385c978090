"""SGLang's engine-control routes: `/server_info` (and its older name
`/get_server_info`), `/abort_request`, `/release_memory_occupation` and
`/resume_memory_occupation`, `/weights_checker` (`checker`), plus the gate that
refuses weight routes while the weights are released.

Request and answer shapes follow SGLang's `http_server.py` and `io_struct.py`
(`AbortReq`: rid, abort_all; `Release/ResumeMemoryOccupationReqInput`: tags;
`CheckWeightsReqInput`: action, allow_quant_error, skip_tensor_list, selector);
answers are this server's `{"success", "message", ...}` objects where SGLang
answers with an empty body or `null`, which no client reads.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from weightsync.server.checker import SELECTORS, WeightChecker
from weightsync.server.memory import WEIGHTS, parse_tags
from weightsync.server.routes_common import HTTPError, admin_json, answer, field_bool, field_str
from weightsync.server.state import ServerState

ENGINE_VERSION = "weightsync-embedded"

WEIGHT_ROUTES = frozenset({
    "/update_weights_from_tensor", "/update_weights_from_distributed", "/update_weights_from_disk",
    "/begin_weight_update", "/end_weight_update", "/get_weights_by_name", "/load_lora_adapter",
    "/load_lora_adapter_from_tensors", "/weightsync/begin", "/weightsync/bucket", "/weightsync/shm_bucket",
    "/weightsync/receive", "/weightsync/commit", "/weightsync/digests", "/weights_checker",
})
"""Routes that read or write the served parameters: refused while they are released."""


def add_routes(app: FastAPI, state: ServerState) -> None:
    app.add_middleware(ReleasedWeightsGate, state=state)

    @app.get("/server_info")
    async def server_info(request: Request) -> dict[str, Any]:
        return _server_info(state, request)

    @app.get("/get_server_info")
    async def get_server_info(request: Request) -> dict[str, Any]:
        """Older SGLang's name (slime tries /server_info, then this)."""
        return _server_info(state, request)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        rid = field_str(body, "rid", default="")
        if field_bool(body, "abort_all", False):
            count = await run_in_threadpool(state.scheduler.abort_all, "aborted by /abort_request (abort_all)")
        elif rid:
            count = await run_in_threadpool(state.scheduler.abort_rid, rid, "aborted by /abort_request")
        else:
            raise HTTPError(400, "/abort_request needs 'rid' (a request id) or 'abort_all': true")
        return answer(f"aborted {count} request(s)", num_aborted=count)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> JSONResponse:
        tags = parse_tags((await admin_json(request, state.config)).get("tags"))
        result = await run_in_threadpool(state.memory.release, tags)
        return answer(f"released {tags}", **result)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        # No tags: every tag, which here means every released one.
        tags = sorted(state.memory.released) if body.get("tags") in (None, []) else parse_tags(body["tags"])
        result = await run_in_threadpool(state.memory.resume, tags)
        return answer(f"resumed {tags}", **result)

    checker = WeightChecker(state.updater)

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(request: Request) -> JSONResponse:
        body = await admin_json(request, state.config)
        selector = field_str(body, "selector", default="all")
        if selector not in SELECTORS:
            raise HTTPError(400, f"selector {selector!r}: this engine has no draft model; use 'all' or 'target'")
        skip = body.get("skip_tensor_list") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise HTTPError(400, "field 'skip_tensor_list' must be a list of name substrings or null")
        action = field_str(body, "action", default="checksum") or "checksum"
        result = await run_in_threadpool(checker.handle, action, skip)
        return answer(**result)


def _server_info(state: ServerState, request: Request) -> dict[str, Any]:
    """The server arguments SGLang reports that apply to this engine (slime compares its
    expected ones, e.g. tp/dp/pp/ep sizes, against these), plus live state."""
    config = state.config
    path = str(config.model_dir)
    return {
        "model_path": state.model_path or path,
        "tokenizer_path": path,
        "served_model_name": path,
        "host": config.host,
        "port": request.url.port or config.port,
        "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0,
        "dtype": "auto",
        "device": "cpu",
        "max_running_requests": config.max_running,
        "enable_lora": config.enable_lora,
        "max_loaded_loras": config.max_loaded_loras,
        "weight_version": state.updater.weights.label,
        "enable_memory_saver": False,
        "disaggregation_mode": "null",
        "skip_server_warmup": True,
        "internal_states": [{"running_requests": state.scheduler.num_running,
                             "waiting_requests": state.scheduler.num_waiting,
                             "memory_released": sorted(state.memory.released)}],
        "version": ENGINE_VERSION,
        "frontend": "python",
    }


class ReleasedWeightsGate:
    """ASGI middleware: 409 on routes that read or write the parameters while the
    weights are released (they hold no memory), naming the route that brings them back."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("path") in WEIGHT_ROUTES and WEIGHTS in self.state.memory.released:  # lifespan: no path
            response = answer(f"{scope['path']}: the weights are released; call /resume_memory_occupation "
                              "with {\"tags\": [\"weights\"]} first", status=409, success=False)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
