"""The engine clients' side of HTTP as units: `engines.json_client.JsonClient` (what it sends,
how every kind of answer comes back) and `SGLangEngine`'s requests to a stock SGLang
(no weightsync routes), against a real HTTP server on 127.0.0.1 that records each
request and answers what the test sets. `weightsync serve`'s own routes are driven by
tests/integration and the contract suite."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync import (
    EngineError,
    Manifest,
    ManifestMismatchError,
    PausePolicy,
    SGLangEngine,
    SyncTimeoutError,
    TensorMeta,
    plan_buckets,
)
from weightsync.engines.base import EngineUpdate
from weightsync.engines.json_client import JsonClient
from weightsync.transports import make_transport, parse_link


class Recorder(ThreadingHTTPServer):
    """Answers `routes[(method, path)] = (status, body bytes)` (404 otherwise) and keeps
    (method, path, Authorization header, JSON body or None) of every request; a path in
    `hold` is answered only once `release` is set."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.routes: dict[tuple[str, str], tuple[int, bytes]] = {}
        self.requests: list[tuple[str, str, str | None, Any]] = []
        self.hold: set[str] = set()
        self.release = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, method: str, path: str, status: int = 200, body: Any = None) -> None:
        raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
        self.routes[(method, path)] = (status, raw)

    def paths(self) -> list[str]:
        return [f"{method} {path}" for method, path, _, _ in self.requests]


class Handler(BaseHTTPRequestHandler):
    server: Recorder

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw and self.headers.get("Content-Type") == "application/json" else None
        self.server.requests.append((self.command, self.path, self.headers.get("Authorization"), body))
        if self.path in self.server.hold:
            self.server.release.wait(60)
        status, answer = self.server.routes.get((self.command, self.path), (404, b'{"detail": "Not Found"}'))
        self.send_response(status)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_GET = do_POST = _handle


@pytest.fixture
def server() -> Iterator[Recorder]:
    recorder = Recorder()
    thread = threading.Thread(target=recorder.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield recorder
    recorder.release.set()
    recorder.shutdown()
    recorder.server_close()


def test_json_client_sends_json_with_the_key_and_counts_requests(server: Recorder) -> None:
    server.answer("POST", "/update", body={"ok": True})
    server.answer("GET", "/empty")
    server.answer("GET", "/text", body=b"plain words")
    server.answer("GET", "/list", body=[1, 2])
    client = JsonClient(server.url + "/", api_key="k3y", timeout_s=10.0)
    try:
        assert client.post("/update", {"a": [1, 2]}) == {"ok": True}
        assert client.post("/update") == {"ok": True}
        assert client.get("/empty") == {}
        assert client.get("/text") == {"text": "plain words"}
        assert client.get("/list") == {"result": [1, 2]}
        assert client.request("GET", "/missing", allow=(404,)).status_code == 404
        assert client.num_requests == 6
    finally:
        client.close()
    assert server.requests[:2] == [("POST", "/update", "Bearer k3y", {"a": [1, 2]}),
                                   ("POST", "/update", "Bearer k3y", {})]


def test_json_client_turns_failed_answers_into_errors_carrying_the_remote_message(server: Recorder) -> None:
    server.answer("POST", "/busy", 503, {"message": "update in progress", "retry_after_s": 2.5})
    server.answer("POST", "/names", 400, {"message": "names differ", "missing": ["a.weight"],
                                          "unexpected": ["b.weight"]})
    server.answer("POST", "/plain", 500, b"boom")
    client = JsonClient(server.url, timeout_s=10.0)
    try:
        with pytest.raises(EngineError, match="/busy: update in progress") as busy:
            client.post("/busy")
        assert busy.value.status == 503 and busy.value.retry_after_s == 2.5
        with pytest.raises(ManifestMismatchError, match="names differ") as names:
            client.post("/names")
        assert names.value.missing == ("a.weight",) and names.value.unexpected == ("b.weight",)
        with pytest.raises(EngineError, match="/plain: boom") as plain:
            client.post("/plain")
        assert plain.value.status == 500
        with pytest.raises(EngineError, match="Not Found") as missing:
            client.get("/nowhere")
        assert missing.value.status == 404
    finally:
        client.close()


def test_json_client_unanswered_is_a_timeout_and_unreachable_an_engine_error(server: Recorder) -> None:
    server.hold.add("/stuck")  # answered only after the test: the client's bound runs out first
    client = JsonClient(server.url, timeout_s=10.0)
    try:
        with pytest.raises(SyncTimeoutError, match="/stuck: no answer within 0.2s"):
            client.post("/stuck", timeout_s=0.2)
    finally:
        client.close()
    closed = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    url = f"http://127.0.0.1:{closed.server_address[1]}"
    closed.server_close()  # nothing listens there now
    client = JsonClient(url, timeout_s=10.0)
    try:
        with pytest.raises(EngineError, match="POST /x failed: ConnectError") as refused:
            client.post("/x")
        assert refused.value.status is None
    finally:
        client.close()


def test_a_stock_sglang_gets_its_own_routes(server: Recorder, tmp_path: Path) -> None:
    """No /weightsync/info (404): broadcast and disk only, no deltas; pauses, the group
    and a disk update go over SGLang's routes, and the ack says nothing was checked."""
    for path in ("/pause_generation", "/continue_generation", "/init_weights_update_group",
                 "/destroy_weights_update_group", "/update_weights_from_disk"):
        server.answer("POST", path, body={"success": True})
    engine = SGLangEngine(server.url, api_key="k", label="stock")
    try:
        caps = engine.capabilities(10.0)
        assert caps.transports == {"broadcast", "disk"} and caps.lora_transports == {"disk"}
        assert not caps.supports_delta and not caps.reads_digests and caps.unloads_adapters

        engine.pause(PausePolicy.RETRACT, timeout_s=10.0)
        engine.resume(timeout_s=10.0)
        group = parse_link({"transport": "broadcast", "master_address": "127.0.0.1", "master_port": 29555,
                            "group_name": "g1", "world_size": 3, "rank_offset": 1, "backend": "gloo"})
        engine.connect(group)
        engine.disconnect(group)

        disk = make_transport("disk", disk_root=tmp_path)
        (link,) = disk.open([1], max_bucket_bytes=64)
        manifest = Manifest(version=7, buckets=plan_buckets([TensorMeta(hf_name="w", dtype=torch.float32,
                                                                        shape=(4,))], 64))
        update = EngineUpdate(version=7, link=link, policy=PausePolicy.RETRACT)  # as the coordinator holds it
        engine.begin(manifest, update)
        ack = engine.commit(manifest, update)
        assert ack.version == 7 and ack.digests == (None,) and ack.loaded_names == {"w"}

        http = make_transport("http").open([1], max_bucket_bytes=64)[0]
        with pytest.raises(EngineError, match="transport 'http' needs weightsync's routes.*use transport="):
            engine.begin(manifest, EngineUpdate(version=7, link=http))
    finally:
        engine.close()
    assert server.paths() == [
        "GET /weightsync/info", "POST /pause_generation", "POST /continue_generation",
        "POST /init_weights_update_group", "POST /destroy_weights_update_group", "POST /update_weights_from_disk"]
    bodies = [body for _, _, _, body in server.requests]
    assert bodies[1] == {"mode": "retract"} and bodies[2] == {}
    assert bodies[3] == {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 3,
                         "group_name": "g1", "backend": "gloo"}
    assert bodies[4] == {"group_name": "g1"}
    assert bodies[5] == {"model_path": str(tmp_path / "v00000007"), "weight_version": "7",
                         "flush_cache": True, "abort_all_requests": False}  # retract flushes
    assert {auth for _, _, auth, _ in server.requests} == {"Bearer k"}
