"""Trainer parameter names -> Hugging Face checkpoint names (`hf_name`), by walking the module tree.

Steps through the wrappers it knows (DDP, torch.compile, activation checkpointing, FSDP2, PEFT)
instead of replacing strings; names fused Mixture-of-Experts parameters as their per-expert
checkpoint tensors (`ExpertSlice`) and groups per-expert names into fused ones (`expert_stacks`).
Reads modules, moves no tensor; unknown layouts raise `NamingError`. Called by `sources/`, `lora/`
and `modes/`. The rules (wrappers, tied weights, buffers): docs/ARCHITECTURE.md; MoE: docs/MOE.md.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from weightsync.errors import NamingError, format_names
from weightsync.stacking import ExpertStack, stack_expert_names

# Wrappers whose only job is to hold the real module in one attribute.
_TRANSPARENT_ATTRS = ("module", "_orig_mod", "_checkpoint_wrapped_module")
_TRANSPARENT_TYPES = ("DistributedDataParallel", "DataParallel", "OptimizedModule", "CheckpointWrapper")
# Tokens that, left in an hf_name, mean a wrapper was not understood.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "base_layer", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


ExpertLayout = Literal["per-expert", "fused"]
"""How an engine loads a Mixture-of-Experts layer's experts: "per-expert", one checkpoint
tensor per expert and projection (what `save_pretrained` writes, what vLLM's and SGLang's
loaders read), or "fused", the 3-D parameters transformers 5 holds (`weightsync serve`)."""
EXPERT_LAYOUTS: tuple[ExpertLayout, ...] = ("per-expert", "fused")


@dataclass(frozen=True)
class ExpertSlice:
    """One checkpoint tensor of a fused 3-D expert parameter: expert `expert` (dim 0),
    then part `part` of `parts` equal chunks of the remaining first dim (gate = 0 and
    up = 1 of `gate_up_proj`; down_proj is one part). Always a view, contiguous where
    the parameter is."""

    expert: int
    part: int = 0
    parts: int = 1

    def of(self, fused: torch.Tensor) -> torch.Tensor:
        """This slice of the whole (unsharded) fused tensor, as a view."""
        one = fused[self.expert]
        return one if self.parts == 1 else one.chunk(self.parts, dim=0)[self.part]

    def shape(self, fused_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The slice's shape, from the fused parameter's full shape."""
        return (fused_shape[1] // self.parts, *fused_shape[2:])


@dataclass(frozen=True)
class ParamName:
    """One trainer parameter (or persistent buffer, or one expert slice of a fused
    parameter) and the checkpoint name it is sent under."""

    hf_name: str
    trainer_name: str
    """The parameter's (or buffer's) name in the trainer's `named_parameters()`."""
    param: torch.Tensor
    """The parameter or buffer as the tree holds it when walked (fused: the whole 3-D one)."""
    expert: ExpertSlice | None = None
    """Where the checkpoint tensor lies in a fused expert parameter (None: the whole tensor)."""
    is_buffer: bool = False
    """A persistent buffer (`module.get_buffer`), not a parameter."""


@dataclass(frozen=True)
class AdapterLayer:
    """A PEFT tuner layer (LoRA) found in the tree."""

    hf_prefix: str
    """Checkpoint name of the wrapped module, e.g. "model.layers.0.self_attn.q_proj"."""
    trainer_prefix: str
    """The same module's name in the trainer's `named_modules()`."""
    layer: nn.Module
    """The PEFT layer: `base_layer`, `lora_A`, `lora_B`, `scaling` ..."""

    @property
    def peft_prefix(self) -> str:
        """The prefix PEFT saves this layer's adapter tensors under."""
        return f"base_model.model.{self.hf_prefix}"


@dataclass(frozen=True)
class ModelNames:
    """The result of walking a model: base weights and adapter layers, in module order."""

    params: tuple[ParamName, ...]
    adapter_layers: tuple[AdapterLayer, ...]

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(p.hf_name for p in self.params)

    def by_hf_name(self) -> dict[str, ParamName]:
        return {p.hf_name: p for p in self.params}


def _peft_types() -> tuple[type, ...] | None:
    """(PeftModel, BaseTuner, BaseTunerLayer) if PEFT is imported, else None.

    A model cannot be a PEFT model unless peft was imported, so peft is never
    imported here just to look.
    """
    if "peft" not in sys.modules:
        return None
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer

    return PeftModel, BaseTuner, BaseTunerLayer


def _is_transparent(module: nn.Module) -> str | None:
    if type(module).__name__ in _TRANSPARENT_TYPES or any(
        c.__name__ in _TRANSPARENT_TYPES for c in type(module).__mro__
    ):
        for attr in _TRANSPARENT_ATTRS:
            if isinstance(getattr(module, attr, None), nn.Module):
                return attr
    return None


def _child(module: nn.Module, attr: str) -> nn.Module:
    child = getattr(module, attr)
    assert isinstance(child, nn.Module), f"{type(module).__name__}.{attr} is not a module"
    return child


class _Walker:
    def __init__(self, adapter_name: str | None, expert_layout: ExpertLayout | None) -> None:
        self.adapter_name = adapter_name
        self.expert_layout = expert_layout
        self.conversions: list[tuple[str, nn.Module]] = []
        """(hf_prefix, model) of the transformers models (`PreTrainedModel`) the walk is
        inside, innermost last: their conversion mappings name fused experts' tensors."""
        self.converters: dict[int, list[tuple[str, tuple[str, ...]]]] = {}
        self.held_in: dict[int, tuple[str, nn.Module, list[str]]] = {}
        """id(model) -> (hf_prefix, model, hf_names of the tensors it is the innermost transformers
        model of): whose conversion mapping names which tensors (`expert_stacks`)."""
        self.outermost: dict[int, tuple[str, nn.Module, list[int]]] = {}
        """id(model) -> (hf_prefix, model, indexes in `params` of the names under it) for each
        outermost transformers model: the one `save_pretrained` is called on, whose reversed
        renamings name its checkpoint (`_checkpoint_names`)."""
        self.params: list[ParamName] = []
        self.adapter_layers: list[AdapterLayer] = []
        self.adapter_param_ids: set[int] = set()
        self.seen: dict[int, str] = {}
        self.peft = _peft_types()

    def walk(self, module: nn.Module, hf_prefix: str, trainer_prefix: str) -> None:
        cls_name = type(module).__name__
        if cls_name == "FullyShardedDataParallel":
            raise NamingError(
                f"{trainer_prefix or 'the model'} is wrapped in FSDP1, which weightsync does not read; "
                "use FSDP2 (torch.distributed.fsdp.fully_shard)"
            )
        attr = _is_transparent(module)
        if attr is not None:
            self.walk(getattr(module, attr), hf_prefix, f"{trainer_prefix}{attr}.")
            return
        if self.peft is not None:
            peft_model, base_tuner, tuner_layer = self.peft
            if isinstance(module, peft_model):
                self.walk(_child(module, "base_model"), hf_prefix, f"{trainer_prefix}base_model.")
                return
            if isinstance(module, base_tuner):
                self.walk(_child(module, "model"), hf_prefix, f"{trainer_prefix}model.")
                return
            if isinstance(module, tuner_layer):
                self._tuner_layer(module, hf_prefix, trainer_prefix)
                return
            if hasattr(module, "modules_to_save") and hasattr(module, "original_module"):
                self._modules_to_save(module, hf_prefix, trainer_prefix)
                return
        pretrained = _is_pretrained(module)
        if pretrained:
            self.conversions.append((hf_prefix, module))
        try:
            if self.expert_layout == "per-expert" and _holds_fused_experts(module):
                self._fused_experts(module, hf_prefix, trainer_prefix)
            else:
                for pname, param in module.named_parameters(recurse=False):
                    self.add(hf_prefix + pname, trainer_prefix + pname, param)
            for bname, buffer in module.named_buffers(recurse=False):
                if buffer is not None and bname not in module._non_persistent_buffers_set:
                    self.add(hf_prefix + bname, trainer_prefix + bname, buffer, is_buffer=True)
            for cname, child in module.named_children():
                self.walk(child, f"{hf_prefix}{cname}.", f"{trainer_prefix}{cname}.")
        finally:
            if pretrained:
                self.conversions.pop()

    def add(self, hf_name: str, trainer_name: str, param: torch.Tensor, *, is_buffer: bool = False,
            slices: Iterable[tuple[str, ExpertSlice]] = ()) -> None:
        if id(param) in self.seen:
            return  # tied: already emitted under its first name
        self.seen[id(param)] = trainer_name
        slices = list(slices)
        first = len(self.params)
        if not slices:
            self.params.append(ParamName(hf_name=hf_name, trainer_name=trainer_name, param=param,
                                         is_buffer=is_buffer))
            if self.conversions:
                prefix, model = self.conversions[-1]
                self.held_in.setdefault(id(model), (prefix, model, []))[2].append(hf_name)
        for slice_name, where in slices:
            self.params.append(ParamName(hf_name=slice_name, trainer_name=trainer_name, param=param, expert=where))
        if self.conversions:
            prefix, model = self.conversions[0]
            self.outermost.setdefault(id(model), (prefix, model, []))[2].extend(range(first, len(self.params)))

    def _fused_experts(self, module: nn.Module, hf_prefix: str, trainer_prefix: str) -> None:
        """Each fused 3-D parameter of a transformers experts module, as its per-expert
        checkpoint tensors (names and split from the model's conversion mapping)."""
        model_prefix, model = self.conversions[-1] if self.conversions else ("", None)
        if model is not None and id(model) not in self.converters:
            self.converters[id(model)] = _expert_converters(model)
        converters = self.converters[id(model)] if model is not None else []
        for pname, param in module.named_parameters(recurse=False):
            hf_name = hf_prefix + pname
            relative = hf_name[len(model_prefix):]
            found = [c for c in converters if relative == c[0] or relative.endswith("." + c[0])]
            if not found:
                raise NamingError(
                    f"{trainer_prefix}{pname} is a fused expert parameter ({type(module).__name__}) with no "
                    "per-expert checkpoint layout in transformers' conversion mapping of this model; push it to "
                    "an engine that takes fused experts (expert_layout='fused')")
            target, patterns = found[0]
            if param.dim() != 3 or param.shape[1] % len(patterns):
                raise NamingError(f"{trainer_prefix}{pname}: shape {tuple(param.shape)} is not [experts, "
                                  f"{len(patterns)} x rows, cols] as its conversion to {patterns} needs")
            stem = hf_name[: len(hf_name) - len(target)]
            slices = [(stem + pattern.replace("*", str(e)), ExpertSlice(expert=e, part=k, parts=len(patterns)))
                      for e in range(param.shape[0]) for k, pattern in enumerate(patterns)]
            self.add(hf_name, trainer_prefix + pname, param, slices=slices)

    def _tuner_layer(self, layer: nn.Module, hf_prefix: str, trainer_prefix: str) -> None:
        base = layer.get_base_layer()  # type: ignore[operator]
        # The direct child `base_layer` may itself be a tuner layer (stacked adapters);
        # get_base_layer() unwraps all of them, so find its trainer path by identity.
        path = next(n for n, m in layer.named_modules() if m is base)
        self.walk(base, hf_prefix, f"{trainer_prefix}{path}.")
        # Every tuner layer of the chain down to the base holds adapters of its own (PEFT nests one
        # ParamWrapper per LoRA'd parameter of a module: target_parameters on gate_up_proj and down_proj).
        inner, at = layer, trainer_prefix.rstrip(".")
        assert self.peft is not None
        while inner is not base:
            self.adapter_layers.append(AdapterLayer(hf_prefix=hf_prefix.rstrip("."), trainer_prefix=at, layer=inner))
            inner, at = inner.base_layer, f"{at}.base_layer"  # type: ignore[assignment]
            if not isinstance(inner, self.peft[2]):
                break
        base_ids = {id(p) for p in base.parameters()}
        self.adapter_param_ids.update(id(p) for p in layer.parameters() if id(p) not in base_ids)

    def _modules_to_save(self, wrapper: nn.Module, hf_prefix: str, trainer_prefix: str) -> None:
        copies = wrapper.modules_to_save  # ModuleDict adapter_name -> trained copy
        name = self.adapter_name or next(iter(copies.keys()), None)  # type: ignore[union-attr, operator]
        if name is None or name not in copies:  # type: ignore[operator]
            raise NamingError(f"{trainer_prefix}modules_to_save has no copy for adapter {name!r}")
        self.walk(copies[name], hf_prefix, f"{trainer_prefix}modules_to_save.{name}.")  # type: ignore[index, arg-type]
        # The frozen original is shadowed by the trained copy: known, not sent.
        self.adapter_param_ids.update(id(p) for p in wrapper.original_module.parameters())  # type: ignore[union-attr]


def _is_pretrained(module: nn.Module) -> bool:
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


_EXPERT_FLAGS = ("is_concatenated", "is_transposed", "has_gate", "has_bias")


def _holds_fused_experts(module: nn.Module) -> bool:
    """A transformers experts module (its class decorated by `use_experts_implementation`,
    which sets these layout flags on every instance) holding 3-D expert parameters."""
    if not all(isinstance(module.__dict__.get(flag), bool) for flag in _EXPERT_FLAGS):
        return False
    return any(p.dim() == 3 for p in module.parameters(recurse=False))


def has_fused_experts(model: nn.Module) -> bool:
    """Whether `model` holds a transformers experts module with fused 3-D parameters (then
    the expert layout an engine loads decides the names sent)."""
    return any(_holds_fused_experts(module) for module in model.modules())


def _expert_converters(model: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """(fused target pattern, per-expert source patterns) of every conversion of `model`
    that stacks per-expert tensors on dim 0 and, for several, concatenates them on dim 1:
    the two transformers declares for its MoE families (its `MergeModulelist(dim=0)`,
    then `Concatenate(dim=1)` for gate and up). Other conversions are left out, so a
    fused parameter converted another way (transposed, interleaved) is refused by name.

    A leading "." of a pattern is dropped: Mixtral's (`.experts.*.w1.weight`) anchor the
    pattern at a name's segment boundary, which matching a pattern as the name's last whole
    segments (here and in `stack_expert_names`) does already."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    out = []
    for conversion in get_model_conversion_mapping(model, add_legacy=False):  # type: ignore[arg-type]
        if not isinstance(conversion, WeightConverter) or len(conversion.target_patterns) != 1:
            continue
        ops = list(conversion.operations)
        sources = tuple(conversion.source_patterns)
        stacked = len(ops) >= 1 and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
        if not stacked or any(p.count("*") != 1 for p in sources):
            continue
        merged = len(ops) == 1 and len(sources) == 1
        concatenated = len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1 and len(sources) > 1
        if merged or concatenated:
            out.append((conversion.target_patterns[0].removeprefix("."), tuple(p.removeprefix(".") for p in sources)))
    return out


def _conversions(model: nn.Module) -> list[Any]:
    """The conversions `from_pretrained` used for `model` (`_weight_conversions`), or for a
    model built another way its default conversion mapping without `PrefixChange`s (nothing
    says whether its checkpoint had the prefix)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type]
                       if not isinstance(c, PrefixChange)]
    return list(conversions)


def _reverse_renamings(model: nn.Module) -> list[Any]:
    """`model`'s `WeightRenaming`s reversed, in the order `save_pretrained` applies them
    (transformers' `revert_weight_conversion`)."""
    from transformers.core_model_loading import WeightRenaming

    reversed_ = [c.reverse_transform() for c in _conversions(model)[::-1]]
    return [r for r in reversed_ if isinstance(r, WeightRenaming)]


def model_names(hf_names: Iterable[str], model: nn.Module) -> dict[str, str]:
    """Checkpoint name -> the name `model` (a transformers model of the architecture) holds it
    under, for each of `hf_names` its `WeightRenaming`s rename as `from_pretrained` does
    (Mixtral: `model.layers.0.block_sparse_moe.gate.weight` -> `...mlp.gate.weight`); empty
    for a model without renamings or one that is not a transformers model."""
    if not _is_pretrained(model):
        return {}
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [c for c in _conversions(model) if isinstance(c, WeightRenaming)]
    if not renamings:
        return {}
    out = {}
    for hf_name in hf_names:
        renamed, _ = rename_source_key(hf_name, renamings, [])
        if renamed != hf_name:
            out[hf_name] = renamed
    return out


def _checkpoint_names(walker: _Walker) -> None:
    """Rename every name under a transformers model to its checkpoint name: the model's
    reversed `WeightRenaming`s (Mixtral's `.block_sparse_moe.` -> `.mlp.` on load, so `mlp.`
    -> `block_sparse_moe.` here, router and experts alike), applied as `save_pretrained`
    applies them (transformers' own `rename_source_key(..., reverse=True)`, names in its
    sorted order, as a group renaming depends on it). The per-expert names the conversions
    made (`_fused_experts`) are already the converters' reversed targets; only the renamings
    are left. Nothing is renamed for a model without renamings (Qwen3-MoE, GLM-4.5, DeepSeek-V3)."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    for prefix, model, indexes in walker.outermost.values():
        renamings = _reverse_renamings(model)
        if not renamings:
            continue
        for i in sorted(indexes, key=lambda i: dot_natural_key(walker.params[i].hf_name[len(prefix):])):
            p = walker.params[i]
            renamed, _ = rename_source_key(p.hf_name[len(prefix):], renamings, [], reverse=True)
            if prefix + renamed != p.hf_name:
                walker.params[i] = dataclasses.replace(p, hf_name=prefix + renamed)


def map_names(
    model: nn.Module,
    *,
    adapter_name: str | None = None,
    expected: Collection[str] | None = None,
    expert_layout: ExpertLayout | None = None,
) -> ModelNames:
    """Walk `model` and name every base weight (and persistent buffer) by its checkpoint name.

    `adapter_name` picks the PEFT adapter whose `modules_to_save` copy is sent
    (default: the first). With `expected` (the checkpoint's keys), any name not
    in it, or any expected name not produced, raises NamingError listing them.
    `expert_layout`: "per-expert" names each fused expert parameter as its
    per-expert checkpoint tensors (`ExpertSlice`s), and every name as the checkpoint
    does (the model's reversed `WeightRenaming`s: Mixtral's `mlp.` is `block_sparse_moe.`
    there), which is what engines that load checkpoints (vLLM, SGLang) take; "fused" or
    None (default) leaves the experts and names as the model holds them (`weightsync
    serve`, which holds transformers' own model).
    """
    if expert_layout is not None and expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"unknown expert_layout {expert_layout!r}; one of {list(EXPERT_LAYOUTS)}")
    walker = _Walker(adapter_name, expert_layout)
    walker.walk(model, "", "")
    if expert_layout == "per-expert":
        _checkpoint_names(walker)
    names = ModelNames(params=tuple(walker.params), adapter_layers=tuple(walker.adapter_layers))
    _check_complete(model, walker)
    _check_unique(names)
    if expected is not None:
        _check_expected(names, expected)
    return names


def checkpoint_slices(model: nn.Module, *, adapter_name: str | None = None
                      ) -> dict[str, list[tuple[str, ExpertSlice | None]]]:
    """Every tensor of `model` that the per-expert (checkpoint) layout names otherwise than the
    model holds it, by the name it is held under (its "fused" layout name, as TRL names what it
    sends) -> its checkpoint tensors in order: (name, where it lies in the fused tensor), or
    (name, None) for a whole tensor the model's renamings name otherwise (Mixtral's router,
    `mlp.gate.weight` -> `block_sparse_moe.gate.weight`). Empty for a model held as its
    checkpoint names it (a dense one)."""
    fused = {p.trainer_name: p.hf_name
             for p in map_names(model, adapter_name=adapter_name, expert_layout="fused").params}
    out: dict[str, list[tuple[str, ExpertSlice | None]]] = {}
    for p in map_names(model, adapter_name=adapter_name, expert_layout="per-expert").params:
        if p.expert is not None or p.hf_name != fused[p.trainer_name]:
            out.setdefault(fused[p.trainer_name], []).append((p.hf_name, p.expert))
    return out


def expert_converters(model: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """(fused target pattern, per-expert source patterns) of `model`'s Mixture-of-Experts
    layers, from transformers' conversion mapping of it (empty for a dense model); `model`
    is any transformers model of the architecture (one built on the meta device will do)."""
    return _expert_converters(model) if _is_pretrained(model) else []


def expert_stacks(model: nn.Module, *, adapter_name: str | None = None) -> tuple[ExpertStack, ...]:
    """The fused checkpoint tensors `model`'s per-expert ones make, for an engine that loads
    experts fused: per transformers model in the tree, its tensors' checkpoint names grouped
    by its conversion mapping (`stack_expert_names`). Empty for a dense model or one that
    holds its experts fused already."""
    walker = _Walker(adapter_name, "fused")
    walker.walk(model, "", "")
    stacks: list[ExpertStack] = []
    for prefix, pretrained, hf_names in walker.held_in.values():
        converters = _expert_converters(pretrained)
        if converters:
            stacks += stack_expert_names(hf_names, converters, prefix=prefix)
    return tuple(stacks)


def _check_complete(model: nn.Module, walker: _Walker) -> None:
    visited = set(walker.seen) | walker.adapter_param_ids
    missed = [n for n, p in model.named_parameters() if id(p) not in visited]
    if missed:
        raise NamingError(
            f"{len(missed)} parameter(s) were not reached while walking the module tree: "
            f"{format_names(missed)}; is the model wrapped in something weightsync does not know?"
        )


def _check_unique(names: ModelNames) -> None:
    owners: dict[str, list[str]] = {}
    for p in names.params:
        owners.setdefault(p.hf_name, []).append(p.trainer_name)
    dups = {k: v for k, v in owners.items() if len(v) > 1}
    if dups:
        detail = "; ".join(f"{k!r} <- {v}" for k, v in sorted(dups.items())[:8])
        raise NamingError(f"{len(dups)} checkpoint name(s) produced by more than one parameter: {detail}")
    leftover = [p.hf_name for p in names.params if _WRAPPER_SEGMENTS & set(p.hf_name.split("."))]
    if leftover:
        raise NamingError(
            f"wrapper segments left in checkpoint names: {format_names(leftover)}; "
            "pass the unwrapped module or a rename table"
        )


def _check_expected(names: ModelNames, expected: Collection[str]) -> None:
    produced = set(names.hf_names)
    unknown = produced - set(expected)
    absent = set(expected) - produced
    if unknown or absent:
        parts = []
        if unknown:
            parts.append(f"not in the checkpoint: {format_names(unknown)}")
        if absent:
            parts.append(f"in the checkpoint but not in the model: {format_names(absent)}")
        raise NamingError("trainer names do not match the checkpoint; " + "; ".join(parts))


def rename(hf_names: Iterable[str], table: Mapping[str, str]) -> dict[str, str]:
    """hf_name -> engine_name through `table` (names not in it keep their name).

    Strict: a table key that matches no hf_name is an error (a stale table is a
    silent bug), and two names must not land on the same engine_name.
    """
    hf_names = list(hf_names)
    stale = set(table) - set(hf_names)
    if stale:
        raise NamingError(f"rename table has keys that match no weight: {format_names(stale)}")
    out = {n: table.get(n, n) for n in hf_names}
    if len(set(out.values())) != len(out):
        seen: dict[str, str] = {}
        clashes = []
        for hf, eng in out.items():
            if eng in seen:
                clashes.append(f"{seen[eng]!r} and {hf!r} -> {eng!r}")
            seen[eng] = hf
        raise NamingError("rename table maps two weights to one name: " + "; ".join(clashes[:8]))
    return out
