"""How the ranks of a sharded trainer take part in one push.

With an FSDP2 model on N ranks, every rank must gather the same tensors in the
same order, but only one rank (the sender, rank 0 of the trainer's group)
talks to the engines. The sender tells the others what to gather, they gather
along (keeping nothing), then every rank receives the sender's outcome, so all
ranks return the same report or raise the same error.

Messages are JSON bytes broadcast over the trainer's own process group (gloo):
nothing is pickled. Every wait has a timeout.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from weightsync.errors import SyncTimeoutError


class TrainerRanks:
    """The trainer's process group as seen by one rank; `None` group = one rank."""

    def __init__(self, group: dist.ProcessGroup | None, *, send_rank: int = 0) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.send_rank = send_rank
        if not 0 <= send_rank < self.world_size:
            raise ValueError(f"send_rank {send_rank} is not a rank of a group of {self.world_size}")

    @property
    def is_sender(self) -> bool:
        return self.rank == self.send_rank

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def share(self, message: dict[str, Any] | None, *, timeout_s: float) -> dict[str, Any]:
        """The sender's `message`, on every rank (the others pass None)."""
        if not self.is_distributed:
            assert message is not None
            return message
        src = self._global(self.send_rank)
        if self.is_sender:
            payload = json.dumps(message).encode()
            size = torch.tensor([len(payload)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size, src, timeout_s)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.is_sender
                else torch.empty(int(size.item()), dtype=torch.uint8))
        if data.numel():
            self._broadcast(data, src, timeout_s)
        return message if self.is_sender else json.loads(bytes(data.numpy()))  # type: ignore[return-value]

    def all_gather_json(self, message: dict[str, Any], *, timeout_s: float) -> list[dict[str, Any]]:
        """Every rank's `message` (JSON), on every rank, in rank order."""
        payload = json.dumps(message, separators=(",", ":")).encode()
        if not self.is_distributed:
            return [json.loads(payload)]
        sizes = self.all_gather(torch.tensor([len(payload)], dtype=torch.int64), timeout_s=timeout_s)
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        everyone = self.all_gather(padded, timeout_s=timeout_s)
        return [json.loads(bytes(everyone[r, : int(sizes[r, 0])].numpy())) for r in range(self.world_size)]

    def all_gather(self, tensor: torch.Tensor, *, timeout_s: float) -> torch.Tensor:
        """Every rank's `tensor` (same shape on every rank), stacked in rank order."""
        if not self.is_distributed:
            return tensor.unsqueeze(0)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._wait(dist.all_gather(out, tensor, group=self.group, async_op=True), "the other ranks", timeout_s)
        return torch.stack(out)

    def gather(self, tensor: torch.Tensor, *, timeout_s: float) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on every rank) on the sender, in rank order;
        an empty list on the other ranks."""
        if not self.is_distributed:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.is_sender else None
        work = dist.gather(tensor, out, dst=self._global(self.send_rank), group=self.group, async_op=True)
        self._wait(work, "the other ranks" if self.is_sender else "the sending rank", timeout_s)
        return out or []

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def _broadcast(self, tensor: torch.Tensor, src: int, timeout_s: float) -> None:
        work = dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        self._wait(work, "the sending rank", timeout_s)

    def _wait(self, work: Any, whom: str, timeout_s: float) -> None:
        try:
            work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise SyncTimeoutError(f"trainer rank {self.rank}: no word from {whom} within {timeout_s:.0f}s: {e}") from e
