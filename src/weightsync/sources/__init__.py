"""Weight sources: where the `(hf_name, tensor)` stream comes from.

Each push mode picks its source (`weightsync.modes`: `make_source(model, mode)`);
the LoRA ones live in `weightsync.lora.source`. A source knows its tensors'
metadata without reading any data (so a bucket plan can be made, and checked by
the engines, before a byte moves) and yields the tensors in the order it is
asked for.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from weightsync.bucketing import TensorParts
from weightsync.manifest import TensorMeta
from weightsync.naming import ExpertLayout
from weightsync.sources.module import ModuleSource
from weightsync.sources.stacked import StackedSource, stacked_source


@runtime_checkable
class WeightSource(Protocol):
    """What `WeightSync.push` reads from. Implement it to sync anything."""

    mode: str
    """"full" for base weights, "lora" for adapter tensors, "lora-merged"."""

    def metas(self) -> Sequence[TensorMeta]:
        """Name, dtype and full shape of every tensor, in a deterministic order."""
        ...

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor | TensorParts]]:
        """Yield the named tensors in exactly the order given (default: `metas()` order).
        A tensor may come as its parts (`TensorParts`: a fused expert tensor stacked from
        per-expert ones, `sources.stacked`), read before the next tensor is asked for.

        Sharded sources gather here: every rank must ask for the same names in
        the same order, or the ranks deadlock.
        """
        ...


@runtime_checkable
class AdapterSource(WeightSource, Protocol):
    """A source of LoRA adapter tensors ("lora" mode), with the adapter's config."""

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the named adapter tensors (always whole) in exactly the order given."""
        ...

    def config(self) -> dict[str, Any]:
        """adapter_config.json contents, as PEFT writes them."""
        ...


@runtime_checkable
class ExpertSource(WeightSource, Protocol):
    """A source holding Mixture-of-Experts layers fused that can send them in the layout an
    engine loads (`EngineCapabilities.expert_layout`), as a module source does."""

    def in_layout(self, expert_layout: ExpertLayout) -> WeightSource:
        """This source with its fused experts as `expert_layout` says ("per-expert": one
        tensor per expert and projection, views of the fused ones)."""
        ...


def as_source(model: object, *, expert_layout: ExpertLayout | None = None) -> WeightSource:
    """`model` itself, which must be a `WeightSource` (what a mode reads when not given a
    module); an `ExpertSource` in `expert_layout` when one is given."""
    if not isinstance(model, WeightSource):
        raise TypeError(f"push() takes an nn.Module or a weightsync.WeightSource, got {type(model).__name__}")
    if expert_layout is not None and isinstance(model, ExpertSource):
        return model.in_layout(expert_layout)
    return model


__all__ = ["AdapterSource", "ExpertSource", "ModuleSource", "StackedSource", "WeightSource", "as_source",
           "stacked_source"]
