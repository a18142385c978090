"""Push modes: what one push sends, one module per mode behind `modes.base.PushMode`.

    full         every tensor                          (modes/full.py)
    delta        only tensors whose bytes changed       (modes/delta.py)
    lora         the adapter alone, versioned names     (modes/lora.py)
    lora-merged  base + adapter merged, as a full push  (modes/merged.py)
    sparse       only the elements that changed, whole-tensor digests acked (modes/sparse.py)

To add a mode: a module with a `PushMode` class, a line in `_MODES` below, and
its name in `weightsync.manifest.MODES` (the manifest's mode field).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import torch
from torch import nn

from weightsync.bucketing import TensorParts
from weightsync.manifest import MODES
from weightsync.modes.base import ModeDefaults, ModeOptions, Planner, PushMode, Selection
from weightsync.naming import ExpertLayout
from weightsync.sources import WeightSource

_MODES: dict[str, str] = {
    "full": "weightsync.modes.full:FullMode",
    "lora": "weightsync.modes.lora:LoraMode",
    "lora-merged": "weightsync.modes.merged:MergedLoraMode",
    "delta": "weightsync.modes.delta:DeltaMode",
    "sparse": "weightsync.modes.sparse:SparseMode",
}
assert tuple(_MODES) == MODES, "every manifest mode has a module, in MODES order"


def make_mode(name: str, options: ModeOptions | None = None) -> PushMode:
    """A fresh `PushMode` called `name` (its state lives as long as one WeightSync)."""
    target = _MODES.get(name)
    if target is None:
        raise ValueError(f"unknown mode {name!r}; one of {list(_MODES)}")
    module_name, class_name = target.split(":")
    mode: PushMode = getattr(importlib.import_module(module_name), class_name)(options or ModeOptions())
    return mode


def make_source(model: nn.Module | WeightSource, mode: str = "full", *,
                adapter_name: str | None = None, expert_layout: ExpertLayout = "per-expert") -> WeightSource:
    """The stream `mode` reads from `model` ("delta" and "sparse" read like "full"); a `WeightSource`
    that is not a module is its own stream. `expert_layout`: see `naming.ExpertLayout`."""
    return make_mode(mode, ModeOptions(adapter_name=adapter_name)).source(model, expert_layout=expert_layout)


def named_weights(model: nn.Module, *, mode: str = "full", adapter_name: str | None = None,
                  expert_layout: ExpertLayout = "per-expert") -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, tensor)` for every weight and persistent buffer of `model` in `mode`, in
    module order; Mixture-of-Experts layers in the checkpoint's per-expert layout unless
    `expert_layout="fused"` (then a model holding its experts one by one gives each fused
    tensor whole, assembled from its parts: a copy, which a push never makes).

    FSDP2 models: a collective per tensor; call on every rank.
    """
    source = make_source(model, mode, adapter_name=adapter_name, expert_layout=expert_layout)
    return ((hf_name, tensor.assemble() if isinstance(tensor, TensorParts) else tensor)
            for hf_name, tensor in source.tensors())


__all__ = [
    "MODES",
    "ModeDefaults",
    "ModeOptions",
    "Planner",
    "PushMode",
    "Selection",
    "make_mode",
    "make_source",
    "named_weights",
]
