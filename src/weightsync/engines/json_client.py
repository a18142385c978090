"""A small JSON-over-HTTP client shared by the engine clients.

Turns every failure into a weightsync error that carries the remote message:
a 4xx/5xx answer into EngineError (or ManifestMismatchError when the engine
listed offending names), a timeout into SyncTimeoutError, a refused or reset
connection into EngineError. Nothing is swallowed.

Counts the requests it sends (`num_requests`), so a push's round trips can be
read off its engine clients. TCP_NODELAY is on for every connection: httpcore
sets it on the sockets of synchronous clients (httpcore >= 0.17, which any
httpx >= 0.27 requires); `weightsync serve` sets it on its end.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from weightsync.errors import EngineError, ManifestMismatchError, SyncTimeoutError


class JsonClient:
    """POST/GET JSON to one server, with a bearer key and a timeout per call."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)
        self._count_lock = threading.Lock()
        self._num_requests = 0

    @property
    def num_requests(self) -> int:
        """Requests sent so far, answered or not (one HTTP round trip each)."""
        return self._num_requests

    def close(self) -> None:
        self._client.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        content: bytes | Iterable[bytes] | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        allow: Iterable[int] = (),
    ) -> httpx.Response:
        """Send a request; raise for any status >= 400 not in `allow`."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._count_lock:  # engine calls run on several threads at once
            self._num_requests += 1
        try:
            response = self._client.request(
                method, path, json=json_body, content=content, headers=headers, params=params, timeout=timeout
            )
        except httpx.TimeoutException as e:
            raise SyncTimeoutError(f"{self.base_url}{path}: no answer within {timeout:.1f}s") from e
        except httpx.TransportError as e:
            raise EngineError(self.base_url, f"{method} {path} failed: {type(e).__name__}: {e}") from e
        if response.status_code >= 400 and response.status_code not in set(allow):
            raise remote_error(self.base_url, path, response)
        return response

    def post(self, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
        return decode(self.request("POST", path, json_body={} if body is None else body, **kw))

    def get(self, path: str, **kw: Any) -> dict[str, Any]:
        return decode(self.request("GET", path, **kw))


def decode(response: httpx.Response) -> dict[str, Any]:
    """The JSON body as a dict ({} for an empty or non-JSON success body)."""
    if not response.content:
        return {}
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"text": response.text}
    return body if isinstance(body, dict) else {"result": body}


def remote_error(engine: str, path: str, response: httpx.Response) -> Exception:
    """The weightsync error for a failed answer, carrying the remote message."""
    body = decode(response)
    message = str(
        body.get("message") or body.get("detail") or body.get("error") or body.get("text") or response.reason_phrase
    )
    if any(k in body for k in ("missing", "unexpected", "mismatched")):
        return ManifestMismatchError(
            f"{engine}{path}: {message}",
            missing=body.get("missing") or (),
            unexpected=body.get("unexpected") or (),
            mismatched=body.get("mismatched") or (),
        )
    retry_after = body.get("retry_after_s")
    retry_after_s = float(retry_after) if isinstance(retry_after, int | float) and retry_after >= 0 else None
    return EngineError(engine, f"{path}: {message}", status=response.status_code, retry_after_s=retry_after_s)
