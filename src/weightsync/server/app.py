"""The HTTP boundary of the embedded engine: FastAPI routes for generation,
health and model info, plus the update and LoRA routes registered from
`routes_updates` and `routes_lora`.

Routes parse and check their input, call into the server state (scheduler,
updater, LoRA store) and shape the answer; blocking work runs in worker
threads so the event loop keeps answering. This is the only place where an
exception of any type becomes an answer (a 4xx/5xx JSON body).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from weightsync.errors import WeightSyncError
from weightsync.server.requests import GenerateItem, GenRequest, parse_generate, to_response
from weightsync.server.routes_common import HTTPError, answer, error_response, read_json, require_admin
from weightsync.server.sampling import SamplingParams, make_generator
from weightsync.server.state import ServerState

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 60.0
_EXPECTED_ERRORS: tuple[type[Exception], ...] = (
    HTTPError, WeightSyncError, ValueError, KeyError, OSError, TimeoutError, ClientDisconnect,
)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving `state`."""
    from weightsync.server import routes_control, routes_lora, routes_updates

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(state.close)

    app = FastAPI(title="weightsync embedded engine", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.server = state
    # Expected errors are answered by the exception middleware; `Exception` (a 500)
    # goes through Starlette's server-error middleware, which also logs it.
    for exc_type in _EXPECTED_ERRORS:
        app.add_exception_handler(exc_type, _handle_error)
    app.add_exception_handler(Exception, _handle_error)
    _add_generation_routes(app, state)
    routes_updates.add_routes(app, state)
    routes_lora.add_routes(app, state)
    routes_control.add_routes(app, state)
    return app


SGLANG_UPDATE_ROUTES = frozenset({
    "/update_weights_from_tensor", "/update_weights_from_distributed", "/update_weights_from_disk",
    "/end_weight_update",
})
"""SGLang's routes that apply an update request on arrival (or at the end of a session)."""


async def _handle_error(request: Request, exc: Exception) -> JSONResponse:
    response = error_response(exc)
    if request.url.path in SGLANG_UPDATE_ROUTES and getattr(request.state, "admin", False):
        _note_refusal(request, response.status_code, str(exc) or type(exc).__name__)
    return response


def _note_refusal(request: Request, status: int, message: str) -> None:
    """A refused SGLang update request may leave its update half applied (server.coverage)."""
    state: ServerState = request.app.state.server
    raw = getattr(request.state, "weight_version", None)
    label = None if raw is None else str(raw)
    session = state.updater.session_info()
    state.updater.weights.coverage.refused(route=request.url.path, label=label, message=f"{status}: {message}",
                                   session_open=session is not None and session["kind"] == "sglang")
    reason = state.updater.weights.coverage.unservable()
    if reason is not None:
        log.warning("%s", reason)


def refuse_if_unservable(state: ServerState) -> None:
    """503 while the served weights are torn or released (server.coverage), or the KV
    cache is released (server.memory)."""
    reason = state.updater.weights.coverage.unservable() or state.memory.unservable()
    if reason is not None:
        raise HTTPError(503, reason)


def _model_info(state: ServerState) -> dict[str, Any]:
    path = str(state.config.model_dir)
    return {"model_path": state.model_path or path, "tokenizer_path": path, "is_generation": True,
            "weight_version": state.updater.weights.label, "preferred_sampling_params": None}


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    limit = state.config.max_json_bytes

    @app.get("/health")
    async def health() -> JSONResponse:
        return answer("ok")

    @app.api_route("/health_generate", methods=["GET", "POST"])
    async def health_generate() -> JSONResponse:
        refuse_if_unservable(state)
        if state.scheduler.paused is not None:
            return answer(f"generation is paused ({state.scheduler.paused}); the server is up")
        item = GenerateItem(prompt_ids=[0], params=SamplingParams(temperature=0.0, max_new_tokens=1),
                            return_logprob=False, logprob_start_len=-1, adapter_name=None, rid="health")
        try:
            [result] = await asyncio.wait_for(_run(state, [item]), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            return answer("generation did not finish in time", status=503, success=False)
        reason = result["meta_info"]["finish_reason"]
        if reason["type"] == "abort":
            return answer(f"generation aborted: {reason.get('message')}", status=503, success=False)
        return answer("ok")

    @app.api_route("/model_info", methods=["GET", "POST"])
    async def model_info() -> dict[str, Any]:
        return _model_info(state)

    @app.api_route("/get_model_info", methods=["GET", "POST"])
    async def get_model_info() -> dict[str, Any]:
        return _model_info(state)

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        """Older SGLang's route (newer ones put the label in /model_info)."""
        return {"weight_version": state.updater.weights.label}

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Any:
        body = await read_json(request, limit)
        refuse_if_unservable(state)
        items, is_batch = parse_generate(body, state.runner.encode)
        for item in items:
            state.runner.check_prompt(item.prompt_ids, item.params.max_new_tokens)
            if item.adapter_name is not None and state.lora_store is None:
                raise HTTPError(400, "lora_path given but the server was started without --enable-lora")
        results = await _run(state, items)
        return results if is_batch else results[0]

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> JSONResponse:
        require_admin(request, state.config.admin_api_key)  # SGLang: AuthLevel.ADMIN_OPTIONAL
        if not state.scheduler.is_idle():
            return answer(
                f"cannot flush the cache: {state.scheduler.num_running} running and "
                f"{state.scheduler.num_waiting} waiting request(s)", status=400, success=False,
            )
        return answer("Cache flushed.")


async def _run(state: ServerState, items: list[GenerateItem]) -> list[dict[str, Any]]:
    """Submit every item, wait for all of them, answer in order."""
    loop = asyncio.get_running_loop()
    requests = _make_requests(state, items)
    futures: list[asyncio.Future[GenRequest]] = []
    for req in requests:
        future: asyncio.Future[GenRequest] = loop.create_future()
        req.on_done = _resolver(loop, future)
        futures.append(future)
    for req in requests:
        if req.params.max_new_tokens == 0:
            req.finish({"type": "length", "length": 0}, state.runner.decode)
            if req.adapter is not None and state.lora_store is not None:
                state.lora_store.release(req.adapter)
        else:
            state.scheduler.submit(req)
    try:
        done = await asyncio.gather(*futures)
    except asyncio.CancelledError:
        for req in requests:
            if not req.finished:
                await run_in_threadpool(state.scheduler.cancel, req, "client went away")
        raise
    return [to_response(req, current=state.updater.weights.served) for req in done]


def _make_requests(state: ServerState, items: list[GenerateItem]) -> list[GenRequest]:
    """GenRequests holding a reference on their adapters (all or none)."""
    requests: list[GenRequest] = []
    try:
        for item in items:
            adapter = None
            if item.adapter_name is not None:
                assert state.lora_store is not None
                adapter = state.lora_store.acquire(item.adapter_name)
            requests.append(GenRequest(
                rid=item.rid, prompt_ids=item.prompt_ids, params=item.params,
                return_logprob=item.return_logprob, logprob_start_len=item.logprob_start_len,
                adapter_name=item.adapter_name, adapter=adapter, generator=make_generator(item.params),
            ))
    except BaseException:
        for req in requests:
            if req.adapter is not None and state.lora_store is not None:
                state.lora_store.release(req.adapter)
        raise
    return requests


def _resolver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[GenRequest]) -> Any:
    def resolve(req: GenRequest) -> None:
        loop.call_soon_threadsafe(_set_result, future, req)

    return resolve


def _set_result(future: asyncio.Future[GenRequest], req: GenRequest) -> None:
    if not future.done():
        future.set_result(req)
