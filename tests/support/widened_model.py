"""The tiny model with widened weights, as the integration and real-vLLM tests use it."""

from __future__ import annotations

from pathlib import Path

import torch

from weightsync.tiny import make_tiny_model


def widen_weights(model: torch.nn.Module, seed: int) -> None:
    """Redraw every non-norm weight with a larger scale (logit std around 2), so greedy
    decoding is decisive and tokens change with the weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            scale = 2.0 / param.shape[-1] ** 0.5 if param.dim() > 1 else 0.4
            param.copy_(torch.randn(param.shape, generator=gen) * scale)


def make_widened_tiny_model(model_dir: Path) -> Path:
    """The tiny float32 Qwen2 (TinyModelConfig defaults) at `model_dir`, weights widened."""
    from transformers import AutoModelForCausalLM

    make_tiny_model(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    widen_weights(model, seed=1)
    model.save_pretrained(model_dir)
    return model_dir
