"""mode="full": every tensor of the model, every push."""

from __future__ import annotations

from typing import ClassVar

from weightsync.modes.base import ModeDefaults


class FullMode(ModeDefaults):
    """The whole model; nothing is remembered between pushes."""

    name: ClassVar[str] = "full"
    sends_shares: ClassVar[bool] = True
