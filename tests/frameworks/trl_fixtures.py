"""What the TRL tests run TRL's `AsyncGRPOTrainer` with on a CPU: a rollout worker that
samples from a real `weightsync serve`, and a CPU stand-in for the one GPU kernel TRL's
tree attention calls.

Why not TRL's own `AsyncRolloutWorker`: it posts vLLM's `/v1/completions` (token ids
and logprobs in vLLM's answer shape), which `weightsync serve` does not serve (it speaks
SGLang's `/generate`), and it tags a rollout with the trainer's version counter, not with
the weights that generated it. This worker implements TRL's `RolloutWorkerProtocol` and
tags each rollout with the version the engine reports it generated with
(`meta_info.weight_versions`), so a test can check which weights made which rollouts.

Why a kernel stand-in: TRL's `tree_attention` (packing.py) calls FlashAttention-3's
`flash_attn_varlen_func`, fetched from the Hub by the `kernels` package, GPU only.
`varlen_attention` is that function's contract in plain torch (causal, aligned to the
end of each key range, grouped-query heads); TRL's own `tree_attention` still runs
around it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import torch
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                     softmax_scale: float | None = None, causal: bool = True,
                     window_size: tuple[int, int] = (-1, -1), **_: Any) -> torch.Tensor:
    """FlashAttention's `flash_attn_varlen_func` in torch: q (total_q, heads, dim), k and v
    (total_k, kv_heads, dim); segment i's queries attend to its keys, causally with the last
    query aligned to the last key (FlashAttention's rule when there are more keys)."""
    assert window_size == (-1, -1), "no sliding window in the tiny models"
    out = torch.empty_like(q)
    repeat = q.shape[1] // k.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        k0, k1 = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[q0:q1].transpose(0, 1)  # heads, Lq, dim
        ki = k[k0:k1].repeat_interleave(repeat, dim=1).transpose(0, 1)
        vi = v[k0:k1].repeat_interleave(repeat, dim=1).transpose(0, 1)
        lq, lk = q1 - q0, k1 - k0
        mask = None
        if causal:
            mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
    return out


VOCAB = 512
"""The tiny models' vocabulary."""


def low_token_reward(completion_ids: list[int]) -> float:
    """The share of completion tokens in the lower half of the vocabulary (about 0.5 for an
    untrained tiny model, with spread within a group, so GRPO's advantages are not zero)."""
    return sum(t < VOCAB // 2 for t in completion_ids) / max(len(completion_ids), 1)


def low_token_rewards(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """`low_token_reward` as a TRL reward function (module level: TRL's worker pickles it)."""
    return [low_token_reward(ids) for ids in completion_ids]


CPU_FLASH_ATTN = SimpleNamespace(flash_attn_varlen_func=varlen_attention)
"""What `trl.experimental.async_grpo.packing._flash_attn()` returns on a GPU (the kernel module)."""


@dataclass
class Batch:
    """One batch of rollouts the worker generated."""

    trl_version: int
    """TRL's `model_version` when the worker generated it."""
    engine_versions: set[int]
    """The weightsync versions the engine reports it generated every token with."""
    group_ids: list[int]
    rewards: list[float] = field(default_factory=list)


class EngineRolloutWorker:
    """TRL's `RolloutWorkerProtocol` over a real `weightsync serve` (SGLang's `/generate`).

    After each weight sync (`update_model_version(v)`) it samples `batches_per_version`
    batches of `prompts_per_batch` prompts x `num_generations` completions (two batches
    after the first sync: accelerate's dispatcher fetches the batch after the one it
    hands out, before that step trains), scores them with `reward`, and queues TRL's
    `RolloutSample`s tagged with the version the engine reports.
    """

    def __init__(self, url: str, prompts: Sequence[Sequence[int]], reward: Callable[[list[int]], float], *,
                 num_generations: int, prompts_per_batch: int, max_new_tokens: int) -> None:
        self.url = url
        self.prompts = [list(p) for p in prompts]
        self.reward = reward
        self.num_generations = num_generations
        self.prompts_per_batch = prompts_per_batch
        self.max_new_tokens = max_new_tokens
        self.rollout_buffer: queue.Queue[RolloutSample] = queue.Queue()
        self.metrics_queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.batches: list[Batch] = []
        self.group_version: dict[int, int] = {}
        """group_id -> the engine-reported version its rollouts were generated with."""
        self._version = 0
        self._done_version = 0
        self._cond = threading.Condition()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._next_group = 0
        self._next_prompt = 0

    # -- TRL's RolloutWorkerProtocol ----------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-rollouts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def update_model_version(self, model_version: int) -> None:
        with self._cond:
            self._version = model_version
            self._cond.notify_all()

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError("the rollout worker failed") from self._error

    # -- generation ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=120.0) as http:
                while True:
                    with self._cond:
                        self._cond.wait_for(lambda: self._stopped or self._version > self._done_version)
                        if self._stopped:
                            return
                        version = self._version
                    for _ in range(2 if self._done_version == 0 else 1):
                        self._generate_batch(http, version)
                    self._done_version = version
        except BaseException as e:  # handed to the trainer through check_health
            self._error = e

    def _generate_batch(self, http: httpx.Client, trl_version: int) -> None:
        batch = Batch(trl_version=trl_version, engine_versions=set(), group_ids=[])
        samples = []
        for _ in range(self.prompts_per_batch):
            prompt = self.prompts[self._next_prompt % len(self.prompts)]
            self._next_prompt += 1
            group_id, self._next_group = self._next_group, self._next_group + 1
            answer = http.post("/generate", json={
                "input_ids": [prompt] * self.num_generations,
                "sampling_params": [{"temperature": 1.0, "max_new_tokens": self.max_new_tokens, "ignore_eos": True,
                                     "seed": 1000 * group_id + i} for i in range(self.num_generations)],
                "return_logprob": True,
            })
            answer.raise_for_status()
            outputs = answer.json()
            rewards = [self.reward(out["output_ids"]) for out in outputs]
            mean, std = float(np.mean(rewards)), float(np.std(rewards))
            versions = {span["weightsync_version"] for out in outputs for span in out["meta_info"]["weight_versions"]}
            batch.engine_versions |= versions
            self.group_version[group_id] = min(versions)
            batch.group_ids.append(group_id)
            batch.rewards.extend(rewards)
            for out, reward in zip(outputs, rewards, strict=True):
                completion = out["output_ids"]
                logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
                samples.append(RolloutSample(
                    prompt=[], completion=[],
                    input_ids=np.asarray(prompt + completion, dtype=np.int64),
                    completion_mask=np.asarray([0] * len(prompt) + [1] * len(completion), dtype=np.int64),
                    old_log_probs=np.asarray([0.0] * len(prompt) + logprobs, dtype=np.float32),
                    advantage=(reward - mean) / (std + 1e-8), model_version=trl_version, group_id=group_id,
                    metrics={"reward": reward}))
        self.batches.append(batch)
        for sample in samples:
            self.rollout_buffer.put(sample)
