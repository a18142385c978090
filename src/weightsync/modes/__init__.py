"""Push modes: what one push sends, one module per mode behind `modes.base.PushMode`.

    full         every tensor                          (modes/full.py)
    delta        only tensors whose bytes changed       (modes/delta.py)
    lora         the adapter alone, versioned names     (modes/lora.py)
    lora-merged  base + adapter merged, as a full push  (modes/merged.py)

To add a mode: a module with a `PushMode` class, a line in `_MODES` below, and
its name in `weightsync.types.MODES` (the manifest's mode field).
"""

from __future__ import annotations

import importlib

from weightsync.modes.base import ModeDefaults, ModeOptions, Planner, PushMode, Selection
from weightsync.types import MODES

_MODES: dict[str, str] = {
    "full": "weightsync.modes.full:FullMode",
    "lora": "weightsync.modes.lora:LoraMode",
    "lora-merged": "weightsync.modes.merged:MergedLoraMode",
    "delta": "weightsync.modes.delta:DeltaMode",
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


__all__ = ["MODES", "ModeDefaults", "ModeOptions", "Planner", "PushMode", "Selection", "make_mode"]
