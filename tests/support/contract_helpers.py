"""Trainer-side helpers for the contract suite (a module, not conftest, so
tests import it by a unique name)."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine_matrix import Client
from weightsync.engines.base import DigestReader, verbs_of

_versions = itertools.count(1)
PROBE_PROMPTS = [[5, 17, 42, 7], [300, 2, 99], [11, 12, 13, 14, 15, 16]]
CAPABILITIES_TIMEOUT_S = 30.0


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


def served_digests(engine: Client) -> dict[str, str] | None:
    """What the engine serves, as digests, where it declares it can tell (else None)."""
    reader = verbs_of(engine, CAPABILITIES_TIMEOUT_S)  # weightsync serve: its own client (engines/serve.py)
    if engine.capabilities(CAPABILITIES_TIMEOUT_S).reads_digests and isinstance(reader, DigestReader):
        return reader.digests()
    return None


def served_state(engine: Client) -> tuple[str, dict[str, str] | None, list[tuple[list[int], list[float]]]]:
    """What a refused push must leave alone: the version, the digests (where the engine
    reads them) and the greedy answers with their logprobs."""
    answers = engine.generate(PROBE_PROMPTS, max_new_tokens=4)
    return engine.weight_version(), served_digests(engine), [(a.output_ids, a.logprobs) for a in answers]
