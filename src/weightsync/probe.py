"""Logprob parity: does the engine compute what the trainer computes?

The engine generates greedily for a few prompts and reports each generated
token's logprob; the trainer scores the same tokens teacher-forced. The gap
between the two is the number RL users chase when "the importance ratios look
wrong": a correct sync leaves only kernel-level noise (float32: ~1e-5,
bf16: ~1e-2); a stale or partial sync shows up as a large gap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from weightsync.engines.base import Completion


class Generator(Protocol):
    """What the probe needs of an engine client (SGLangEngine and VLLMEngine have it)."""

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 lora_name: str | None = None, seed: int | None = None) -> list[Completion]: ...


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """Trainer vs engine on the engine's own greedy continuations."""

    max_gap: float
    """Largest |engine logprob - trainer logprob| over all generated tokens."""
    mean_gap: float
    """Mean absolute gap."""
    token_agreement: float
    """Fraction of generated tokens that are also the trainer's argmax."""
    num_tokens: int
    """Tokens compared."""
    weight_versions: tuple[str, ...]
    """The weight_version the engine reported for each prompt."""


def trainer_logprobs(
    model: nn.Module, prompt: Sequence[int], output: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced logprobs of `output` after `prompt`, and the argmax at each step."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(output)], device=device)
    logits = model(input_ids=ids).logits[0].float()
    steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]
    logprobs = torch.log_softmax(steps, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(output, device=device).unsqueeze(1)).squeeze(1)
    return chosen.cpu(), steps.argmax(dim=-1).cpu()


def probe_logprobs(
    model: nn.Module,
    engine: Generator,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 8,
    lora_name: str | None = None,
) -> ProbeResult:
    """Generate greedily on `engine`, score the same tokens with `model`, compare."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("probe_logprobs needs at least one non-empty prompt")
    completions = engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0, lora_name=lora_name)
    gaps: list[torch.Tensor] = []
    agree = total = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for prompt, completion in zip(prompts, completions, strict=True):
                if not completion.output_ids:
                    continue
                if len(completion.logprobs) != len(completion.output_ids):
                    raise ValueError(f"engine returned {len(completion.logprobs)} logprobs for "
                                     f"{len(completion.output_ids)} tokens; ask for return_logprob")
                ours, argmax = trainer_logprobs(model, prompt, completion.output_ids)
                theirs = torch.tensor(completion.logprobs, dtype=torch.float32)
                gaps.append((ours - theirs).abs())
                agree += int((argmax == torch.tensor(completion.output_ids)).sum())
                total += len(completion.output_ids)
    finally:
        model.train(was_training)
    flat = torch.cat(gaps) if gaps else torch.zeros(0)
    return ProbeResult(
        max_gap=float(flat.max()) if flat.numel() else 0.0,
        mean_gap=float(flat.mean()) if flat.numel() else 0.0,
        token_agreement=agree / total if total else 1.0,
        num_tokens=total,
        weight_versions=tuple(c.weight_version for c in completions),
    )


def as_dict(result: ProbeResult) -> dict[str, Any]:
    return {
        "max_gap": result.max_gap, "mean_gap": result.mean_gap, "token_agreement": result.token_agreement,
        "num_tokens": result.num_tokens, "weight_versions": list(result.weight_versions),
    }
