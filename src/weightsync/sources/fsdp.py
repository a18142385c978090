"""Reading FSDP2 (`fully_shard`) parameters: DTensors gathered one at a time.

Gathering is a collective over the parameter's device mesh: EVERY rank of that
mesh must gather the same tensors in the same order, or the ranks deadlock.
weightsync guarantees this by deriving the order from the bucket plan, which is
a pure function of the model's metadata and so identical on every rank.

Nothing here gathers more than one tensor at a time; what is kept after the
gather is the caller's choice (only the sending rank keeps the bytes).
"""

from __future__ import annotations

import torch
from torch import nn


def is_dtensor(tensor: torch.Tensor) -> bool:
    """True for a torch.distributed DTensor (an FSDP2-sharded parameter)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole, unsharded value of `tensor`, detached.

    For a DTensor this is a collective (all-gather): all ranks of its mesh must
    call it for the same tensor at the same time. Plain tensors are returned
    as they are (no copy).
    """
    tensor = tensor.detach()
    if is_dtensor(tensor):
        with torch.no_grad():
            return tensor.full_tensor()  # type: ignore[attr-defined]
    return tensor


def global_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape (a DTensor's `.shape` is already the global one)."""
    return tuple(tensor.shape)


def is_sharded(model: nn.Module) -> bool:
    """True if any parameter of `model` is a DTensor."""
    return any(is_dtensor(p) for p in model.parameters())
