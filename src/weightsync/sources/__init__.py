"""Weight sources: where the `(hf_name, tensor)` stream comes from.

A source knows its tensors' metadata without reading any data (so a bucket
plan can be made, and checked by the engines, before a byte moves) and yields
the tensors in the order it is asked for.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from weightsync.sources.module import ModuleSource
from weightsync.types import MODES, TensorMeta


@runtime_checkable
class WeightSource(Protocol):
    """What `WeightSync.push` reads from. Implement it to sync anything."""

    mode: str
    """"full" for base weights, "lora" for adapter tensors, "lora-merged"."""

    def metas(self) -> Sequence[TensorMeta]:
        """Name, dtype and full shape of every tensor, in a deterministic order."""
        ...

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the named tensors in exactly the order given (default: `metas()` order).

        Sharded sources gather here: every rank must ask for the same names in
        the same order, or the ranks deadlock.
        """
        ...


@runtime_checkable
class AdapterSource(WeightSource, Protocol):
    """A source of LoRA adapter tensors ("lora" mode), with the adapter's config."""

    def config(self) -> dict[str, Any]:
        """adapter_config.json contents, as PEFT writes them."""
        ...


def make_source(model: nn.Module | WeightSource, mode: str = "full", *, adapter_name: str | None = None) -> WeightSource:
    """The source for `model` in `mode` ("delta" reads like "full")."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
    if isinstance(model, WeightSource) and not isinstance(model, nn.Module):
        return model
    if mode in ("full", "delta"):
        return ModuleSource(model, adapter_name=adapter_name)
    from weightsync.sources.peft import LoraSource, MergedLoraSource

    if mode == "lora":
        return LoraSource(model, adapter_name=adapter_name)
    return MergedLoraSource(model, adapter_name=adapter_name)


def named_weights(
    model: nn.Module, *, mode: str = "full", adapter_name: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, tensor)` for every weight of `model` in `mode`, in module order.

    FSDP2 models: a collective per tensor; call on every rank.
    """
    return make_source(model, mode, adapter_name=adapter_name).tensors()


__all__ = ["AdapterSource", "ModuleSource", "WeightSource", "make_source", "named_weights"]
