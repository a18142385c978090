"""HTTP plumbing shared by the routes: bounded bodies, JSON fields, the admin key,
and the one place where exceptions become JSON answers.

Every answer is `{"success": bool, "message": str, ...}`. Input mistakes are
4xx naming the offender; only an exception nobody anticipated becomes a 500.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from weightsync.errors import (
    IntegrityError,
    ManifestMismatchError,
    StagingMemoryError,
    SyncTimeoutError,
    WeightSyncError,
)
from weightsync.formats.wire import FrameHeader, check_payload_length, decode_frame, decode_header
from weightsync.server.config import ServerConfig
from weightsync.server.errors import ConflictError

log = logging.getLogger(__name__)


class HTTPError(Exception):
    """An answer with a status chosen by the route."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def answer(message: str = "", *, status: int = 200, success: bool = True, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=status)


def error_response(exc: BaseException) -> JSONResponse:
    """Map an exception to its JSON answer."""
    status, extra = _status_of(exc)
    if status == 500:
        log.error("unhandled error: %s: %s", type(exc).__name__, exc, exc_info=exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
    elif status > 500:  # anticipated (504: a group or broadcast timed out): no traceback
        log.warning("failed (%d): %s", status, exc)
        message = str(exc) or type(exc).__name__
    else:
        log.info("refused (%d): %s", status, exc)
        message = str(exc) or type(exc).__name__
    return answer(message, status=status, success=False, **extra)


def _status_of(exc: BaseException) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, HTTPError):
        return exc.status, {}
    if isinstance(exc, ManifestMismatchError):
        return 400, {"missing": list(exc.missing), "unexpected": list(exc.unexpected),
                     "mismatched": list(exc.mismatched)}
    if isinstance(exc, ConflictError):
        return 409, {} if exc.retry_after_s is None else {"retry_after_s": round(exc.retry_after_s, 3)}
    if isinstance(exc, StagingMemoryError):
        return 413, {"needed_bytes": exc.needed_bytes, "available_bytes": exc.available_bytes}
    if isinstance(exc, SyncTimeoutError | TimeoutError):
        return 504, {}
    if isinstance(exc, PermissionError):
        return 403, {}
    if isinstance(exc, FileNotFoundError | NotADirectoryError | IsADirectoryError | ClientDisconnect):
        return 400, {}
    if isinstance(exc, WeightSyncError | ValueError | KeyError):
        return 400, {}
    return 500, {}


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes without reading further."""
    _check_declared(request, limit)
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise HTTPError(413, f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_frame(request: Request, limit: int,
                     alloc: Callable[[FrameHeader], torch.Tensor]) -> tuple[FrameHeader, torch.Tensor]:
    """A bucket frame (`formats.wire`) read from the body straight into `alloc(header)`, a
    uint8 buffer of the header's `nbytes`: the body is never held whole, so a frame costs its
    payload once, not the body, its pieces and a copy. Refused (413) past `limit` bytes;
    IntegrityError (400) for a malformed frame or a payload not of its header's length."""
    _check_declared(request, limit)
    head = bytearray()
    header: FrameHeader | None = None
    payload = torch.empty(0, dtype=torch.uint8)
    target = memoryview(b"")
    filled = 0
    async for chunk in request.stream():
        piece = memoryview(chunk)
        if header is None:
            head += piece
            if len(head) > limit:
                raise HTTPError(413, f"request body exceeds the {limit}-byte limit")
            decoded = decode_header(head)
            if decoded is None:
                continue
            header, end = decoded
            if end + header.nbytes > limit:
                raise HTTPError(413, f"bucket frame of {end + header.nbytes} bytes exceeds the {limit}-byte limit")
            payload = alloc(header)
            target = payload.numpy().data.cast("B")
            piece = memoryview(bytes(head[end:]))
        if filled + len(piece) > len(target):
            raise IntegrityError(f"bucket {header.index}: frame carries more than the {header.nbytes} payload "
                                 "bytes its header says")
        target[filled:filled + len(piece)] = piece
        filled += len(piece)
    if header is None:
        decode_frame(bytes(head))  # raises: the frame ends inside its prefix or header
        raise AssertionError("unreachable")
    check_payload_length(header, filled)
    return header, payload


def _check_declared(request: Request, limit: int) -> None:
    """413 where the request declares a body longer than `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise HTTPError(400, f"bad Content-Length {declared!r}") from None
        if size > limit:
            raise HTTPError(413, f"request body of {size} bytes exceeds the {limit}-byte limit")


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """A JSON object body (an empty body is `{}`), plus query parameters for GETs."""
    body = await read_body(request, limit)
    data: Any = {}
    if body.strip():
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, f"request body must be a JSON object, got {type(data).__name__}")
    if request.method == "GET":
        data = {**dict(request.query_params), **data}
    request.state.weight_version = data.get("weight_version")  # for refusals (server.coverage)
    return data


def require_admin(request: Request, key: str | None) -> None:
    """401 unless the request carries `Authorization: Bearer <key>` (when a key is set)."""
    if key is not None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise HTTPError(401, "this route needs the admin key: send 'Authorization: Bearer <admin key>'")
    request.state.admin = True  # its refusals may mark the served weights torn (server.coverage)


async def admin_json(request: Request, config: ServerConfig) -> dict[str, Any]:
    """The JSON body of a mutating route: the admin key checked, then the body read within the size limit."""
    require_admin(request, config.admin_api_key)
    return await read_json(request, config.max_json_bytes)


def field_str(body: Mapping[str, Any], key: str, *, default: str | None = None, required: bool = False) -> str | None:
    value = body.get(key, default)
    if value is None:
        if required:
            raise HTTPError(400, f"missing required field {key!r}")
        return None
    if not isinstance(value, str):
        raise HTTPError(400, f"field {key!r} must be a string, got {type(value).__name__}")
    return value


def field_int(body: Mapping[str, Any], key: str, *, default: int | None = None, required: bool = False) -> int | None:
    value = body.get(key, default)
    if value is None:
        if required:
            raise HTTPError(400, f"missing required field {key!r}")
        return None
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            raise HTTPError(400, f"field {key!r} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HTTPError(400, f"field {key!r} must be an integer, got {value!r}")
    return value


def field_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise HTTPError(400, f"field {key!r} must be a boolean, got {value!r}")
    return value


def weight_version_field(body: Mapping[str, Any], key: str = "weight_version") -> str | None:
    """SGLang's `weight_version` label: any string (an integer is taken as its decimal
    string); None when absent. It names the weights in answers and orders nothing."""
    value = body.get(key)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise HTTPError(400, f"field {key!r} must be a string (a label such as \"v1\"), got {value!r:.80}")
