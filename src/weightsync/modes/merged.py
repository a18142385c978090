"""mode="lora-merged": the base weights with the LoRA delta merged in, layer by layer.

The trainer's own weights stay bit-identical: merged tensors are computed out of
place (`W + scale * B @ A`) by `sources.peft.MergedLoraSource`, one at a time.
Engines take them like a full update.
"""

from __future__ import annotations

from typing import ClassVar

from weightsync.modes.base import ModeDefaults


class MergedLoraMode(ModeDefaults):
    """Merged weights of a PEFT model, as a full update."""

    name: ClassVar[str] = "lora-merged"
