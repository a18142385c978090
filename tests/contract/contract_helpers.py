"""Trainer-side helpers for the contract suite (a module, not conftest, so
tests import it by a unique name)."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

_versions = itertools.count(1)


def next_version() -> int:
    """A weight version newer than every one pushed so far in this session."""
    return next(_versions)


def load_trainer(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def perturb(model: torch.nn.Module, seed: int, *, only: str | None = None) -> None:
    """Add seeded noise to every weight (or to weights whose name contains `only`)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.05
            if only is None or only in name:
                p.add_(noise.to(p.dtype))
