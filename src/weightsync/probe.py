"""Logprob parity: does the engine compute what the trainer computes?

The engine generates greedily for a few prompts and reports each generated token's logprob;
the trainer scores the same tokens teacher-forced. A correct sync leaves only kernel-level
noise (float32: ~1e-5, bf16: ~1e-2); a stale or partial one shows up as a large gap. An
engine serving quantized weights is compared with the weights as a push sends them
(`as_sent`), the gap to the trainer's own weights reported beside it (docs/QUANTIZED.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
    quantized: str | None = None
    """The engine's quantized format ("int8-channel", "fp8-block"), where it serves one: the gaps
    above are then to the weights as sent (quantized and dequantized), not to the trainer's."""
    trainer_max_gap: float | None = None
    """For a quantized engine: the largest gap to the trainer's own (unquantized) weights. Reported,
    not a bound: it is what quantizing costs, plus the kernel's error."""
    trainer_mean_gap: float | None = None
    """For a quantized engine: the mean gap to the trainer's own weights."""


def trainer_logprobs(
    model: nn.Module, prompt: Sequence[int], output: Sequence[int],
    weights: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced logprobs of `output` after `prompt`, and the argmax at each step; with
    `weights`, those of the model's parameters replaced (`torch.func.functional_call`)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(output)], device=device)
    if weights:
        logits = torch.func.functional_call(model, dict(weights), args=(), kwargs={"input_ids": ids}).logits
    else:
        logits = model(input_ids=ids).logits
    steps = logits[0].float()[len(prompt) - 1 : len(prompt) - 1 + len(output)]
    logprobs = torch.log_softmax(steps, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(output, device=device).unsqueeze(1)).squeeze(1)
    return chosen.cpu(), steps.argmax(dim=-1).cpu()


def as_sent(model: nn.Module, quantization: Any) -> dict[str, torch.Tensor]:
    """The weights of `model` that an engine serving `quantization` (`formats.quantized.Quantization`)
    holds quantized, each quantized and dequantized as a push sends and the engine computes it,
    in the parameter's dtype. Raises ValueError naming the quantized weights `model` does not hold
    under the checkpoint's names."""
    params = dict(model.named_parameters())
    missing = sorted(set(quantization.scales) - set(params))
    if missing:
        raise ValueError(f"the engine serves {len(missing)} weight(s) quantized that the model does not hold under "
                         f"those names ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); probe "
                         "with the model whose parameter names are the checkpoint's")
    fmt = quantization.format
    out = {}
    with torch.no_grad():
        for name in quantization.scales:
            param = params[name]
            out[name] = fmt.dequantize(*fmt.quantize(param, hf_name=name)).to(param.dtype)
    return out


def _engine_quantization(engine: Any) -> Any:
    """The engine's declared quantization (its client's `capabilities`), None where it has none."""
    capabilities: Callable[[float], Any] | None = getattr(engine, "capabilities", None)
    return None if capabilities is None else capabilities(30.0).quantization


def probe_logprobs(
    model: nn.Module,
    engine: Generator,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 8,
    lora_name: str | None = None,
) -> ProbeResult:
    """Generate greedily on `engine`, score the same tokens with `model` (with the weights as sent,
    for a quantized engine), compare."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("probe_logprobs needs at least one non-empty prompt")
    quantization = _engine_quantization(engine)
    sent = as_sent(model, quantization) if quantization is not None and lora_name is None else None
    completions = engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0, lora_name=lora_name)
    gaps: list[torch.Tensor] = []
    trainer_gaps: list[torch.Tensor] = []
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
                theirs = torch.tensor(completion.logprobs, dtype=torch.float32)
                ours, argmax = trainer_logprobs(model, prompt, completion.output_ids, sent)
                gaps.append((ours - theirs).abs())
                if sent is not None:
                    trainer_gaps.append((trainer_logprobs(model, prompt, completion.output_ids)[0] - theirs).abs())
                agree += int((argmax == torch.tensor(completion.output_ids)).sum())
                total += len(completion.output_ids)
    finally:
        model.train(was_training)
    max_gap, mean_gap = _max_and_mean(gaps)
    trainer_max_gap, trainer_mean_gap = _max_and_mean(trainer_gaps) if sent is not None else (None, None)
    return ProbeResult(
        max_gap=max_gap,
        mean_gap=mean_gap,
        token_agreement=agree / total if total else 1.0,
        num_tokens=total,
        weight_versions=tuple(c.weight_version for c in completions),
        quantized=None if sent is None else quantization.format.kind,
        trainer_max_gap=trainer_max_gap,
        trainer_mean_gap=trainer_mean_gap,
    )


def _max_and_mean(gaps: list[torch.Tensor]) -> tuple[float, float]:
    """The largest and the mean of the per-prompt gaps; 0.0 for no tokens."""
    flat = torch.cat(gaps) if gaps else torch.zeros(0)
    return (float(flat.max()), float(flat.mean())) if flat.numel() else (0.0, 0.0)


def as_dict(result: ProbeResult) -> dict[str, Any]:
    return {
        "max_gap": result.max_gap, "mean_gap": result.mean_gap, "token_agreement": result.token_agreement,
        "num_tokens": result.num_tokens, "weight_versions": list(result.weight_versions),
        **({"quantized": result.quantized, "trainer_max_gap": result.trainer_max_gap,
            "trainer_mean_gap": result.trainer_mean_gap} if result.quantized else {}),
    }
