"""Base weights of a trainer's module as a stream of `(hf_name, tensor)`.

Covers plain modules, DDP, torch.compile, FSDP2 and the base weights of a PEFT
model (unmerged, LoRA tensors left out). Names come from `naming.map_names`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

import torch
from torch import nn

from weightsync.naming import map_names
from weightsync.sources.fsdp import full_tensor, global_shape
from weightsync.types import TensorMeta


class ModuleSource:
    """The base weights of `model`, named by checkpoint name.

    For FSDP2 models `tensors()` gathers: every rank must call it with the
    same names in the same order (see `sources.fsdp`).
    """

    mode = "full"

    def __init__(
        self,
        model: nn.Module,
        *,
        adapter_name: str | None = None,
        expected: Collection[str] | None = None,
    ) -> None:
        self.model = model
        self._params = map_names(model, adapter_name=adapter_name, expected=expected).by_hf_name()

    def metas(self) -> list[TensorMeta]:
        return [
            TensorMeta(hf_name=name, dtype=ref.param.dtype, shape=global_shape(ref.param))
            for name, ref in self._params.items()
        ]

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._params if hf_names is None else hf_names:
            try:
                param = self._params[name].param
            except KeyError:
                raise KeyError(f"{name!r} is not a weight of this model") from None
            yield name, full_tensor(param)
