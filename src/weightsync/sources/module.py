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
    same names in the same order (see `sources.fsdp`). Parameters are looked
    up when read, not when the source is made: FSDP2 swaps a module's
    parameters between sharded and unsharded tensors around forward passes.
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
        self._trainer_names = {
            p.hf_name: p.trainer_name
            for p in map_names(model, adapter_name=adapter_name, expected=expected).params
        }
        self._paths: dict[str, list[str]] = {}
        """hf_name -> its trainer name's segments, split once."""
        self._metas: dict[str, TensorMeta] = {}
        """hf_name -> the meta `metas` gave last (immutable, so shared)."""

    def param(self, hf_name: str) -> torch.Tensor:
        """The parameter `hf_name` as the model holds it now (an FSDP2 DTensor: this rank's shard)."""
        try:
            trainer_name = self._trainer_names[hf_name]
        except KeyError:
            raise KeyError(f"{hf_name!r} is not a weight of this model") from None
        # The module tree's own dicts, one lookup per path segment: what get_parameter
        # finds, at a fraction of its cost (it goes through getattr on every segment).
        module: nn.Module | None = self.model
        *path, leaf = self._paths.get(hf_name) or self._paths.setdefault(hf_name, trainer_name.split("."))
        for segment in path:
            module = module._modules.get(segment) if module is not None else None
        param = module._parameters.get(leaf) if module is not None else None
        if isinstance(param, nn.Parameter):
            return param
        return self.model.get_parameter(trainer_name)  # anything unusual: its own lookup (and error)

    def metas(self) -> list[TensorMeta]:
        """Every weight's name, dtype and shape as the model holds it now. The same meta
        object comes back while its weight's dtype and shape stay, so that comparing two
        pushes' metas (is the last plan still good?) is mostly identity checks."""
        out = []
        known = self._metas
        for name in self._trainer_names:
            p = self.param(name)
            shape = global_shape(p)
            meta = known.get(name)
            if meta is None or meta.dtype != p.dtype or meta.shape != shape:
                meta = known[name] = TensorMeta(hf_name=name, dtype=p.dtype, shape=shape)
            out.append(meta)
        return out

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._trainer_names if hf_names is None else hf_names:
            yield name, full_tensor(self.param(name))
