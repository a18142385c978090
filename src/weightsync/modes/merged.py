"""mode="lora-merged": the base weights with the LoRA delta merged in, layer by layer.

The trainer's own weights stay bit-identical: merged tensors are computed out of
place (`W + scale * B @ A`) by `lora.source.MergedLoraSource`, one at a time.
Engines take them like a full update; a model holding its experts one by one, into an
engine that loads them fused, sends each merged expert as a part of its fused tensor
(`sources.stacked`).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from weightsync.modes.base import ModeDefaults
from weightsync.naming import ExpertLayout, expert_stacks
from weightsync.sources import StackedSource, WeightSource, as_source


class MergedLoraMode(ModeDefaults):
    """Merged weights of a PEFT model, as a full update."""

    name: ClassVar[str] = "lora-merged"

    def source(self, model: nn.Module | WeightSource, *, expert_layout: ExpertLayout = "per-expert") -> WeightSource:
        if not isinstance(model, nn.Module):
            return as_source(model)
        from weightsync.lora.source import MergedLoraSource  # imports peft

        source = MergedLoraSource(model, adapter_name=self.options.adapter_name, expert_layout=expert_layout)
        # experts held one by one, into an engine that loads them fused: each merged expert a part of its fused tensor
        stacks = expert_stacks(model, adapter_name=self.options.adapter_name) if expert_layout == "fused" else ()
        return StackedSource(source, stacks) if stacks else source
