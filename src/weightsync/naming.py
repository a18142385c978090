"""Trainer parameter names -> Hugging Face checkpoint names (`hf_name`).

Names are mapped by walking the module tree and stepping through the wrappers
we know, never by string replacement: a token such as "module" or "default" can
be a real module name. The wrappers:

- DDP / DataParallel (`module.`), torch.compile (`_orig_mod.`), activation
  checkpointing (`_checkpoint_wrapped_module.`): transparent.
- FSDP2 (`fully_shard`): names unchanged, parameters are DTensors.
- PEFT: `PeftModel.base_model` (`base_model.`), the tuner's `.model`
  (`model.`), LoRA layers (the real weight lives in `.base_layer.`; the
  adapter weights under `lora_A.<adapter>` etc. are recorded separately), and
  `modules_to_save` wrappers (the trained copy is the one sent).

Parameters are visited once each (tied weights are shared Parameter objects),
so a model with tied embeddings yields `model.embed_tokens.weight` and no
`lm_head.weight`, exactly like its saved checkpoint. Buffers are not weights
and are never sent.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from weightsync.errors import NamingError, format_names

# Wrappers whose only job is to hold the real module in one attribute.
_TRANSPARENT_ATTRS = ("module", "_orig_mod", "_checkpoint_wrapped_module")
_TRANSPARENT_TYPES = ("DistributedDataParallel", "DataParallel", "OptimizedModule", "CheckpointWrapper")
# Tokens that, left in an hf_name, mean a wrapper was not understood.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "base_layer", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


@dataclass(frozen=True)
class ParamName:
    """One trainer parameter and the checkpoint name it is sent under."""

    hf_name: str
    trainer_name: str
    param: torch.Tensor


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
    def __init__(self, adapter_name: str | None) -> None:
        self.adapter_name = adapter_name
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
        for pname, param in module.named_parameters(recurse=False):
            self.add(hf_prefix + pname, trainer_prefix + pname, param)
        for cname, child in module.named_children():
            self.walk(child, f"{hf_prefix}{cname}.", f"{trainer_prefix}{cname}.")

    def add(self, hf_name: str, trainer_name: str, param: torch.Tensor) -> None:
        if id(param) in self.seen:
            return  # tied: already emitted under its first name
        self.seen[id(param)] = trainer_name
        self.params.append(ParamName(hf_name=hf_name, trainer_name=trainer_name, param=param))

    def _tuner_layer(self, layer: nn.Module, hf_prefix: str, trainer_prefix: str) -> None:
        base = layer.get_base_layer()  # type: ignore[operator]
        # The direct child `base_layer` may itself be a tuner layer (stacked adapters);
        # get_base_layer() unwraps all of them, so find its trainer path by identity.
        path = next(n for n, m in layer.named_modules() if m is base)
        self.walk(base, hf_prefix, f"{trainer_prefix}{path}.")
        self.adapter_layers.append(
            AdapterLayer(hf_prefix=hf_prefix.rstrip("."), trainer_prefix=trainer_prefix.rstrip("."), layer=layer)
        )
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


def map_names(
    model: nn.Module,
    *,
    adapter_name: str | None = None,
    expected: Collection[str] | None = None,
) -> ModelNames:
    """Walk `model` and name every base weight by its checkpoint name.

    `adapter_name` picks the PEFT adapter whose `modules_to_save` copy is sent
    (default: the first). With `expected` (the checkpoint's keys), any name not
    in it, or any expected name not produced, raises NamingError listing them.
    """
    walker = _Walker(adapter_name)
    walker.walk(model, "", "")
    names = ModelNames(params=tuple(walker.params), adapter_layers=tuple(walker.adapter_layers))
    _check_complete(model, walker)
    _check_unique(names)
    if expected is not None:
        _check_expected(names, expected)
    return names


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
