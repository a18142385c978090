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

PLAIN_TENSORS = (torch.Tensor, nn.Parameter)
"""Tensor types that are never a DTensor: `full_tensor` of one is its `detach()`."""
_dtensor_type: type | None = None


def is_dtensor(tensor: torch.Tensor) -> bool:
    """True for a torch.distributed DTensor (an FSDP2-sharded parameter). A plain tensor or
    parameter costs one type check: a push asks this of every tensor it reads."""
    global _dtensor_type
    if type(tensor) in PLAIN_TENSORS:
        return False
    if _dtensor_type is None:  # imported on first need (torch.distributed is a heavy import)
        from torch.distributed.tensor import DTensor

        _dtensor_type = DTensor
    return isinstance(tensor, _dtensor_type)


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


def local_shard(tensor: torch.Tensor, hf_name: str, *, rank: int, world_size: int) -> torch.Tensor | None:
    """This rank's rows of an FSDP2 parameter (a DTensor sharded on dim 0 over a 1-d mesh
    of the trainer's ranks, mesh coordinate = rank: the rows follow in rank order), detached;
    None for a plain tensor (every rank holds all of it). Raises ValueError, naming the
    tensor, for any other layout (HSDP's 2-d mesh, tensor parallelism)."""
    if not is_dtensor(tensor):
        return None
    from torch.distributed.tensor import Shard

    mesh, placements = tensor.device_mesh, tensor.placements  # type: ignore[attr-defined]
    if mesh.ndim != 1 or tuple(placements) != (Shard(0),) or mesh.size() != world_size \
            or mesh.get_local_rank() != rank:
        raise ValueError(
            f"{hf_name}: sharded as {tuple(placements)} over a mesh of shape {tuple(mesh.shape)} (this rank at "
            f"{mesh.get_coordinate()}); mode='sparse' with a process_group takes FSDP2's layout only (Shard(0) "
            f"over a 1-d mesh whose coordinates are the process group's {world_size} ranks in order); use "
            "mode='delta' or 'full' for this model")
    return tensor.to_local().detach()  # type: ignore[attr-defined]


def global_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The unsharded shape (a DTensor's `.shape` is already the global one)."""
    return tuple(tensor.shape)


def is_sharded(model: nn.Module) -> bool:
    """True if any parameter of `model` is a DTensor."""
    return any(is_dtensor(p) for p in model.parameters())
