"""The trainer ranks that do not send: with a `process_group`, every rank calls
`WeightSync.push`; the sending rank talks to the engines and tells the others what to
gather next, and at the end how the push ended, so every rank returns the same report."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from weightsync.errors import WeightSyncError
from weightsync.modes import PushMode, make_source
from weightsync.push.rank_shares import ShareOrder
from weightsync.reports import SyncReport
from weightsync.sources import WeightSource
from weightsync.trainer_ranks import TrainerRanks


def follow(model: nn.Module | WeightSource, mode: PushMode, ranks: TrainerRanks, *, adapter_name: str | None,
           timeout_s: float, send: Callable[[WeightSource, ShareOrder], object]) -> SyncReport:
    """On a rank that does not send: gather what the sender gathers, return its outcome.

    The sender says what to gather next ({"mode", "order", "expert_layout"}), which buckets
    this rank sends its own share of instead ({"shares"}: `send`, `weightsync.push.rank_shares`)
    or which step of its mode to run ({"step"}), until it says how the push ended
    ({"report"} or {"error"}).
    """
    while True:
        message: dict[str, Any] = ranks.share(None, timeout_s=timeout_s * 4)
        if "error" in message:
            raise WeightSyncError(f"the sending trainer rank failed: {message['error']}")
        if "report" in message:
            return SyncReport.from_dict(message["report"])
        if "step" in message:
            mode.follow(model, message["step"], message.get("order"), ranks, timeout_s=timeout_s)
            continue
        source = make_source(model, message["mode"], adapter_name=adapter_name,
                             expert_layout=message.get("expert_layout", "per-expert"))
        if "shares" in message:
            send(source, ShareOrder.from_message(message["shares"]))
            continue
        for _ in source.tensors(message["order"]):
            pass
