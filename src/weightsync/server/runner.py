"""The model: loading a Hugging Face causal LM on CPU and running one step.

`ModelRunner.step` advances a group of requests by one token. Requests whose
KV caches have the same length and that use the same adapter are stacked into
one batch (no padding, so every row sees exactly the positions and attention
it would see alone); a request without a cache (new, or retracted) is
prefilled over its prompt plus the tokens generated so far. The runner knows
nothing about queues, pausing or HTTP: the scheduler decides who steps and
holds the lock that keeps weight swaps out of a step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightsync.server.requests import Decode, GenRequest, ServedVersion, stop_reason
from weightsync.server.sampling import next_token

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutcome:
    """What one step did to one request."""

    request: GenRequest
    token: int
    finish_reason: dict[str, Any] | None


class ModelRunner:
    """A causal LM and its tokenizer, loaded once, stepped by the scheduler thread."""

    def __init__(self, model_dir: str | Path, *, model: nn.Module | None = None) -> None:
        """`model`: the model of `model_dir`, loaded by the caller (a quantized checkpoint,
        `server.quantized.load_quantized`); None loads it with transformers."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model_dir = Path(model_dir)
        self.model: nn.Module = model if model is not None else \
            AutoModelForCausalLM.from_pretrained(self.model_dir, dtype="auto").eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        config: Any = self.model.config
        self.config = config
        self.vocab_size: int = int(config.vocab_size)
        self.max_positions: int = int(getattr(config, "max_position_embeddings", 1 << 30))
        self.eos_ids: frozenset[int] = _eos_ids(self.model, self.tokenizer)
        self._batchable = _plain_dynamic_cache(config)
        self.lora: Any = None
        """A lora.LoraStore when LoRA is enabled: the runner activates a request's adapter around its forward."""

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def check_prompt(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """Refuse prompts the model cannot run; raises ValueError naming the problem."""
        if not prompt_ids:
            raise ValueError("the prompt is empty: give non-empty `text` or `input_ids`")
        bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) + max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} exceeds the "
                f"model's {self.max_positions} positions"
            )

    def step(self, requests: Sequence[GenRequest], *, served: ServedVersion) -> list[StepOutcome]:
        """Advance every request by one token, computed with the weights `served` names."""
        outcomes: list[StepOutcome] = []
        for group in group_for_batching(requests, batchable=self._batchable):
            outcomes.extend(self._step_group(group, served))
        return outcomes

    @torch.no_grad()
    def _step_group(self, group: list[GenRequest], served: ServedVersion) -> list[StepOutcome]:
        from transformers import DynamicCache

        first = group[0]
        want_input_logprobs = [r.cache is None and r.return_logprob and r.logprob_start_len >= 0
                               and r.input_logprobs is None for r in group]
        input_ids = torch.tensor([r.pending_ids() for r in group], dtype=torch.long)
        cache = _stack_caches([r.cache for r in group], self.config) if first.cache is not None \
            else DynamicCache(config=self.config)
        keep = 0 if any(want_input_logprobs) else 1
        with self._adapter(first):
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=keep)
        caches = _split_cache(out.past_key_values, len(group), self.config)
        outcomes = []
        for row, req in enumerate(group):
            if want_input_logprobs[row]:
                req.input_logprobs = _prompt_logprobs(out.logits[row], req.prompt_ids, req.logprob_start_len)
            req.cache = caches[row]
            token, logprob = next_token(out.logits[row, -1], req.params, req.generator)
            req.output_ids.append(token)
            req.output_logprobs.append(logprob)
            req.record_served(served)
            outcomes.append(StepOutcome(req, token, stop_reason(req, token, self.eos_ids, self.decode)))
        return outcomes

    def _adapter(self, req: GenRequest) -> contextlib.AbstractContextManager[None]:
        """Apply `req`'s LoRA adapter (if any) to the forward pass inside the block."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.activate(req.adapter)


def group_for_batching(requests: Sequence[GenRequest], *, batchable: bool = True) -> list[list[GenRequest]]:
    """Split requests into batches that can run as one forward pass without padding.

    Rows of one batch share the adapter, the cache length and the number of
    tokens fed, so positions and causal masks are identical to running alone.
    Order is stable (first come first served within and across groups).
    """
    if not batchable:
        return [[r] for r in requests]
    groups: dict[tuple[Any, int, int], list[GenRequest]] = {}
    for r in requests:
        cached = len(r.all_ids) - 1 if r.cache is not None else 0
        key = (r.adapter_name, cached, len(r.pending_ids()))
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def _prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], start: int) -> list[float | None]:
    """logprob of each prompt token given its prefix, from position `start` (the first has none)."""
    logprobs = torch.log_softmax(logits[: len(prompt_ids)].float(), dim=-1)
    out: list[float | None] = []
    for pos in range(start, len(prompt_ids)):
        out.append(None if pos == 0 else float(logprobs[pos - 1, prompt_ids[pos]]))
    return out


def _plain_dynamic_cache(config: Any) -> bool:
    """True when every cache layer is a full-attention DynamicLayer (rows can be stacked)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _stack_caches(caches: Sequence[Any], config: Any) -> Any:
    from transformers import DynamicCache

    if len(caches) == 1:
        return caches[0]
    layers = zip(*(c.layers for c in caches), strict=True)
    return DynamicCache(
        ddp_cache_data=[
            (torch.cat([layer.keys for layer in per_layer]), torch.cat([layer.values for layer in per_layer]))
            for per_layer in layers
        ],
        config=config,
    )


def _split_cache(cache: Any, rows: int, config: Any) -> list[Any]:
    from transformers import DynamicCache

    if rows == 1:
        return [cache]
    return [
        DynamicCache(ddp_cache_data=[(layer.keys[i : i + 1], layer.values[i : i + 1]) for layer in cache.layers],
                     config=config)
        for i in range(rows)
    ]


def _eos_ids(model: nn.Module, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


__all__ = ["Decode", "ModelRunner", "StepOutcome", "group_for_batching"]
