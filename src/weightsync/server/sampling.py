"""Sampling parameters and next-token selection, as SGLang defines them.

Pure: a row of logits in, a token id and its logprob out. The logprob is
log_softmax of the logits divided by the temperature (1 for greedy), taken
before top-k/top-p filtering, which is what SGLang reports by default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_MAX_NEW_TOKENS = 128
SAMPLING_EPS = 1e-6
"""Temperatures below this sample greedily, as in SGLang (dividing logits by them overflows)."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """SGLang's `sampling_params`, the subset this engine implements."""

    temperature: float = 1.0
    """0 (or below SAMPLING_EPS) means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    """Tokens to generate at most."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the text is cut before them."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    seed: int | None = None
    """Seed of this request's sampling generator (temperature > 0)."""

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @classmethod
    def from_json(cls, raw: Mapping[str, Any] | None) -> SamplingParams:
        """Parse and validate; raises ValueError naming the bad field. Unknown keys are ignored."""
        raw = raw or {}
        if not isinstance(raw, Mapping):
            raise ValueError("sampling_params must be an object")
        temperature = _number(raw, "temperature", 1.0)
        top_p = _number(raw, "top_p", 1.0)
        top_k = _integer(raw, "top_k", -1)
        max_new_tokens = _integer(raw, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        seed = raw.get("seed", raw.get("sampling_seed"))
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"sampling_params.temperature must be a finite number >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
        if max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {max_new_tokens}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"sampling_params.seed must be an integer, got {seed!r}")
        return cls(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            stop=_strings(raw.get("stop")),
            stop_token_ids=_ints(raw.get("stop_token_ids"), "stop_token_ids"),
            ignore_eos=bool(raw.get("ignore_eos", False)),
            seed=seed,
        )


def _number(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"sampling_params.{key} must be a number, got {value!r}")
    return float(value)


def _integer(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sampling_params.{key} must be an integer, got {value!r}")
    return value


def _strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ValueError("sampling_params.stop must be a non-empty string or a list of them")
    return tuple(value)


def _ints(value: Any, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"sampling_params.{key} must be a list of integers")
    return tuple(value)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The per-request generator: seeded by `params.seed`, else from fresh entropy."""
    if params.greedy:
        return None
    gen = torch.Generator()
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def filter_top_k_top_p(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero all but the top-k tokens and the smallest top-p nucleus; renormalise. 1-d `probs`."""
    if 0 < top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=0)
        # Keep a token if the mass before it is below top_p (so the first is always kept).
        keep_sorted = (cumulative - sorted_probs) < top_p
        keep = torch.zeros_like(keep_sorted)
        keep[order] = keep_sorted
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, float]:
    """Pick the next token from one row of logits; returns (token_id, logprob)."""
    logits = logits.float()
    if params.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = filter_top_k_top_p(logprobs.exp(), params.top_k, params.top_p)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])
