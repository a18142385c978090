"""A trainer's per-expert Mixture-of-Experts tensors sent as the fused ones an engine loads
(`expert_layout="fused"`).

Rewrites a source's names and stream: each fused tensor is planned, digested and acked as one and
streamed as its parts (`bucketing.TensorParts`), packed straight into place. Which parts make which
tensor comes from `naming.expert_stacks`; an incomplete set is refused before a byte moves. Knows no
engines or transports; reads the inner source in the order asked (under FSDP2 every rank asks the
same). Design: docs/MOE.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

from weightsync.bucketing import TensorParts
from weightsync.manifest import TensorMeta
from weightsync.naming import expert_converters, model_names
from weightsync.stacking import ExpertStack, stack_expert_names


class InnerSource(Protocol):
    """What a stacked source reads: a `weightsync.sources.WeightSource` (restated here, as that
    package imports this module)."""

    mode: str

    def metas(self) -> Sequence[TensorMeta]:
        ...

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor | TensorParts]]:
        ...


class StackedSource:
    """`inner` with the per-expert tensors of each `ExpertStack` sent as their fused tensor,
    at the place of its first part; every other tensor as `inner` has it, under the name
    `renamed` gives it, if any (the model's names where its checkpoint's differ: Mixtral's
    `block_sparse_moe.` is `mlp.`)."""

    def __init__(self, inner: InnerSource, stacks: Sequence[ExpertStack], renamed: Mapping[str, str] | None = None
                 ) -> None:
        self.inner = inner
        self.mode = inner.mode
        self.stacks = {stack.hf_name: stack for stack in stacks}
        """Fused checkpoint name -> the per-expert tensors it is stacked from."""
        self._first_parts = {stack.parts[0]: stack for stack in stacks}
        self._parts = {part for stack in stacks for part in stack.parts}
        self.renamed = dict(renamed or {})
        """Checkpoint name (a fused tensor's, or `inner`'s) -> the name it is sent under."""
        self._checkpoint_name = {sent: held for held, sent in self.renamed.items()}

    def metas(self) -> list[TensorMeta]:
        """`_checkpoint_metas`, each under the name it is sent under."""
        renamed = self.renamed
        return [dataclasses.replace(m, hf_name=renamed[m.hf_name]) if m.hf_name in renamed else m
                for m in self._checkpoint_metas()]

    def _checkpoint_metas(self) -> list[TensorMeta]:
        """`inner`'s metas, each stack's parts replaced by its fused tensor: `[num_experts,
        num_parts x rows, cols...]` of the parts' dtype, which must agree (ValueError naming
        the tensors otherwise)."""
        inner = list(self.inner.metas())
        by_name = {m.hf_name: m for m in inner}
        out = []
        for meta in inner:
            stack = self._first_parts.get(meta.hf_name)
            if stack is not None:
                out.append(self._fused_meta(stack, by_name))
            elif meta.hf_name not in self._parts:
                out.append(meta)
        return out

    def _fused_meta(self, stack: ExpertStack, by_name: dict[str, TensorMeta]) -> TensorMeta:
        absent = [name for name in stack.parts if name not in by_name]
        if absent:
            raise ValueError(f"{stack.hf_name} is stacked from {len(absent)} tensor(s) this source does not hold "
                             f"({absent[:4]}...); make the StackedSource from the source's own names")
        first = by_name[stack.parts[0]]
        odd = [name for name in stack.parts if (by_name[name].dtype, by_name[name].shape) != (first.dtype, first.shape)]
        if odd or len(first.shape) < 2:
            raise ValueError(f"{stack.hf_name} stacks tensors of one dtype and shape (at least 2-d), as "
                             f"{stack.parts[0]} is ({first.dtype}, {first.shape}); these differ: "
                             f"{[(n, by_name[n].dtype, by_name[n].shape) for n in odd[:4]]}")
        rows, *rest = first.shape
        return TensorMeta(hf_name=stack.hf_name, dtype=first.dtype,
                          shape=(stack.num_experts, stack.num_parts * rows, *rest))

    def param(self, hf_name: str) -> torch.Tensor:
        """The tensor as the trainer holds it (`sources.ModuleSource.param`), which
        `send_shares=True` reads each rank's rows of; a fused tensor has none: ValueError."""
        if self._checkpoint_name.get(hf_name, hf_name) in self.stacks:
            raise ValueError(f"{hf_name} is stacked from per-expert tensors for an engine that loads experts fused; "
                             "no trainer rank holds rows of it, which send_shares=True sends: use send_shares=False")
        inner = getattr(self.inner, "param", None)  # a ModuleSource's
        if inner is None:
            raise ValueError(f"send_shares=True reads each rank's rows of the model's parameters: push the model "
                             f"(an nn.Module), not a {type(self.inner).__name__}")
        held: torch.Tensor = inner(self._checkpoint_name.get(hf_name, hf_name))
        return held

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor | TensorParts]]:
        """The named tensors in the order given; a fused one as its parts (`TensorParts`, read
        from `inner` as they are packed; whatever the consumer leaves unread is read before
        the next tensor, so a rank that packs nothing still gathers along)."""
        metas = self._checkpoint_metas()
        checkpoint_name = self._checkpoint_name
        names = ([m.hf_name for m in metas] if hf_names is None
                 else [checkpoint_name.get(name, name) for name in hf_names])
        renamed = self.renamed
        stacks = self.stacks
        shapes = {m.hf_name: m.shape for m in metas if m.hf_name in stacks}
        expanded: list[str] = []
        for hf_name in names:
            stack = stacks.get(hf_name)
            expanded += (hf_name,) if stack is None else stack.parts
        inner = iter(self.inner.tensors(expanded))
        for hf_name in names:
            stack = stacks.get(hf_name)
            if stack is None:
                name, tensor = next(inner)
                assert name == hf_name, (name, hf_name)
                yield renamed.get(hf_name, hf_name), tensor
                continue
            shape = shapes[hf_name]
            parts = TensorParts(_named_parts(inner, stack), shape=shape,
                                part_shape=(shape[1] // stack.num_parts, *shape[2:]))
            yield renamed.get(hf_name, hf_name), parts
            parts.drain()


def _named_parts(inner: Iterator[tuple[str, torch.Tensor | TensorParts]],
                 stack: ExpertStack) -> Iterator[tuple[str, torch.Tensor]]:
    """The next `len(stack.parts)` tensors of `inner`, checked to be `stack`'s parts in order."""
    for expected in stack.parts:
        name, tensor = next(inner)
        assert name == expected and isinstance(tensor, torch.Tensor), (name, expected)
        yield name, tensor


def stacked_source(source: InnerSource, conversions_of: nn.Module) -> InnerSource:
    """`source` (a stream of checkpoint tensors: a Megatron-style export, per-expert tensors
    in hand) with its per-expert tensors stacked into the fused ones an engine of
    `expert_layout="fused"` loads, by the conversion mapping of `conversions_of` (a
    transformers model of the same architecture; built on the meta device, it costs no
    memory). Names the model's renamings change are sent as the model holds them (a
    Mixtral's `block_sparse_moe.gate.weight` and its stacked `block_sparse_moe.experts.*`
    as `mlp.gate.weight` and `mlp.experts.*`, as `from_pretrained` renames them). `source`
    itself when it holds no per-expert tensors and no such name. NamingError, naming them,
    for an incomplete set of experts."""
    held = [m.hf_name for m in source.metas()]
    stacks = stack_expert_names(held, expert_converters(conversions_of))
    parts = {part for stack in stacks for part in stack.parts}
    sent = [*(stack.hf_name for stack in stacks), *(name for name in held if name not in parts)]
    renamed = model_names(sent, conversions_of)
    return StackedSource(source, stacks, renamed) if stacks or renamed else source


__all__ = ["StackedSource", "stacked_source"]
