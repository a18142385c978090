"""Base weights of a trainer's module as a stream of `(hf_name, tensor)`.

Covers plain modules, DDP, torch.compile, FSDP2 and the base weights of a PEFT
model (unmerged, LoRA tensors left out), with their persistent buffers. Names
come from `naming.map_names`; Mixture-of-Experts models in the layout the
engines load (`expert_layout`): one expert of a fused 3-D parameter is a view
of it, cast and packed straight into its bucket by the pipeline.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

import torch
from torch import nn

from weightsync.manifest import TensorMeta
from weightsync.naming import ExpertLayout, ParamName, map_names
from weightsync.sources.fsdp import PLAIN_TENSORS, full_tensor, global_shape, is_dtensor


class ModuleSource:
    """The base weights of `model`, named by checkpoint name.

    For FSDP2 models `tensors()` gathers: every rank must call it with the
    same names in the same order (see `sources.fsdp`). Parameters are looked
    up in their module when read, not when the source is made: FSDP2 swaps a
    module's parameters between sharded and unsharded tensors around forward
    passes. The modules themselves are the tree's when the source was made:
    after replacing a module, make a new source (a push mode does).

    `expert_layout` ("per-expert" by default, the checkpoint layout): fused expert
    parameters are sent as one tensor per expert and projection, each a view of
    the parameter (under FSDP2 the parameter is gathered once for the run of its
    experts that `tensors()` is asked for in a row); "fused" sends them as held.
    """

    mode = "full"

    def __init__(
        self,
        model: nn.Module,
        *,
        adapter_name: str | None = None,
        expected: Collection[str] | None = None,
        expert_layout: ExpertLayout = "per-expert",
    ) -> None:
        self.model = model
        self.expert_layout = expert_layout
        self._names: dict[str, ParamName] = {
            p.hf_name: p
            for p in map_names(model, adapter_name=adapter_name, expected=expected, expert_layout=expert_layout).params
        }
        self._slots: dict[str, tuple[dict[str, torch.Tensor | None], str]] = {}
        """trainer name -> the `_parameters` (or `_buffers`) dict of the module that holds it,
        and its key there: found once by walking the tree, then read with one lookup."""
        self._metas: dict[str, TensorMeta] = {}
        """hf_name -> the meta `metas` gave last (immutable, so shared)."""
        self._reads: dict[str, tuple[dict[str, torch.Tensor | None], str, tuple[type, ...]]] = {}
        """hf_name of a weight held whole -> its slot (see `_slots`) and the types of what `_held`
        reads there as is and yields detached (a parameter: `nn.Parameter`; a buffer: a plain
        tensor): `metas` and `tensors` read such a weight inline, anything else through `_held`."""

    def _held(self, name: ParamName) -> torch.Tensor:
        """The parameter or buffer as the model holds it now, read from its module's own dict
        (what get_parameter finds, at a fraction of its cost: it goes through getattr on
        every segment). The modules are the ones this source named: a module replaced in
        the tree since needs a new source (a mode makes one, `modes.base.tree_fingerprint`);
        a parameter replaced within its module (FSDP2 swaps sharded and unsharded ones) is
        read as it is now."""
        slot = self._slots.get(name.trainer_name)
        if slot is None:
            slot = self._slot(name)
        held = slot[0].get(slot[1])
        if held is None or (not name.is_buffer and not isinstance(held, nn.Parameter)):
            trainer_name = name.trainer_name  # anything unusual: its own lookup (and error)
            return self.model.get_buffer(trainer_name) if name.is_buffer else self.model.get_parameter(trainer_name)
        return held

    def _slot(self, name: ParamName) -> tuple[dict[str, torch.Tensor | None], str]:
        *path, leaf = name.trainer_name.split(".")
        module: nn.Module | None = self.model
        for segment in path:
            module = module._modules.get(segment) if module is not None else None
        if module is None:
            return {}, leaf  # not cached: the fallback lookup raises, naming it
        slot: tuple[dict[str, torch.Tensor | None], str] = (
            module._buffers if name.is_buffer else module._parameters, leaf)  # type: ignore[assignment]
        self._slots[name.trainer_name] = slot
        if name.expert is None:
            self._reads[name.hf_name] = (*slot, PLAIN_TENSORS if name.is_buffer else (nn.Parameter,))
        return slot

    def _name(self, hf_name: str) -> ParamName:
        try:
            return self._names[hf_name]
        except KeyError:
            raise KeyError(f"{hf_name!r} is not a weight of this model") from None

    def param(self, hf_name: str) -> torch.Tensor:
        """The tensor `hf_name` as the model holds it now (an FSDP2 DTensor: this rank's shard;
        one expert of a fused parameter: a view of it, which a sharded parameter has none of)."""
        name = self._name(hf_name)
        held = self._held(name)
        if name.expert is None:
            return held
        if is_dtensor(held):
            raise ValueError(f"{hf_name} is one expert of {name.trainer_name}, which FSDP2 shards by expert rows: "
                             "this rank holds no tensor of that name alone; use tensors(), which gathers")
        return name.expert.of(held)

    def metas(self) -> list[TensorMeta]:
        """Every weight's name, dtype and shape as the model holds it now. The same meta
        object comes back while its weight's dtype and shape stay, so that comparing two
        pushes' metas (is the last plan still good?) is mostly identity checks."""
        out = []
        known, reads = self._metas, self._reads
        for hf_name, name in self._names.items():
            read = reads.get(hf_name)
            held = None if read is None else read[0].get(read[1])
            if held is None or read is None or type(held) not in read[2]:
                held = self._held(name)
            meta = known.get(hf_name)
            if name.expert is None:  # the common case: the held tensor's own shape (a DTensor's is global)
                if meta is None or meta.dtype != held.dtype or meta.shape != held.shape:
                    meta = known[hf_name] = TensorMeta(hf_name=hf_name, dtype=held.dtype, shape=global_shape(held))
            else:
                shape = name.expert.shape(global_shape(held))
                if meta is None or meta.dtype != held.dtype or meta.shape != shape:
                    meta = known[hf_name] = TensorMeta(hf_name=hf_name, dtype=held.dtype, shape=shape)
            out.append(meta)
        return out

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """`WeightSource.tensors`. A weight held whole comes as a detached alias, or, read
        under `torch.no_grad()` (a push packs there), as the parameter itself: nothing
        can record a graph on it there, and a detached alias costs a microsecond a tensor."""
        gathered: tuple[str, torch.Tensor] | None = None  # the fused parameter whose experts are being read
        names, reads, grad_enabled = self._names, self._reads, torch.is_grad_enabled
        for hf_name in names if hf_names is None else hf_names:
            read = reads.get(hf_name)
            if read is not None:  # a weight held whole, read as `_held` reads it (the common case)
                whole = read[0].get(read[1])
                if whole is not None and type(whole) in read[2]:
                    gathered = None
                    # under no_grad (a push's packing) nothing can record a graph on it: no detached alias
                    yield hf_name, whole.detach() if grad_enabled() else whole
                    continue
            name = names.get(hf_name) or self._name(hf_name)  # (which raises, naming it)
            if name.expert is None:
                gathered = None
                held = self._held(name)
                yield hf_name, held.detach() if type(held) in PLAIN_TENSORS else full_tensor(held)
                continue
            if gathered is None or gathered[0] != name.trainer_name:
                gathered = None  # drop the last one before gathering the next
                gathered = (name.trainer_name, full_tensor(self._held(name)))
            yield hf_name, name.expert.of(gathered[1])
