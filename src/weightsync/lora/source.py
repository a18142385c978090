"""LoRA streams from a PEFT model: the adapter alone ("lora"), or merged into the base ("lora-merged").

Reads the trainer's PEFT model and never writes to it: no PEFT merge, no in-place op on a parameter
(under FSDP2 `safe_merge` would leave training on merged weights). Math in `lora.merge`, names from
`naming`, FSDP2 gathers one tensor at a time, so every rank iterates the same names in the same
order, or the ranks deadlock. Called by `modes/` (lora, lora-merged) and `lora.export`. What is
supported and what is refused: docs/USAGE.md ("LoRA three ways").
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from peft import PeftModel
from peft.tuners.lora.layer import Embedding as LoraEmbedding
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.lora.layer import LoraLayer
from peft.tuners.lora.layer import ParamWrapper as LoraParamWrapper
from peft.utils import PeftType
from peft.utils.other import ModulesToSaveWrapper
from torch import nn

from weightsync.lora.merge import merge_bias, merge_embedding, merge_linear
from weightsync.manifest import TensorMeta
from weightsync.naming import AdapterLayer, ExpertLayout, ModelNames, map_names
from weightsync.sources.fsdp import full_tensor, global_shape, is_dtensor

logger = logging.getLogger(__name__)

SUPPORTED = (
    "plain LoRA (peft_type LORA) on nn.Linear / Conv1D layers (and nn.Embedding in "
    "mode 'lora-merged'), with or without rslora, dropout, lora_bias and modules_to_save"
)


# --- finding the adapter ---------------------------------------------------------


def find_peft_model(model: nn.Module) -> PeftModel:
    """The `PeftModel` inside `model` (itself, or under DDP / torch.compile / FSDP2)."""
    for module in model.modules():
        if isinstance(module, PeftModel):
            return module
    raise ValueError(
        f"{type(model).__name__} is not a PEFT model; modes 'lora' and 'lora-merged' need a "
        "peft.PeftModel (from peft.get_peft_model); use mode='full' for a plain model"
    )


def resolve_adapter_name(peft_model: PeftModel, adapter_name: str | None) -> str:
    """`adapter_name`, checked; by default the single active adapter."""
    available = list(peft_model.peft_config)
    if adapter_name is None:
        active = list(peft_model.active_adapters)
        if len(active) != 1:
            raise ValueError(f"{len(active)} adapters are active ({active}); pass adapter_name= one of {available}")
        adapter_name = active[0]
    if adapter_name not in peft_model.peft_config:
        raise ValueError(f"the model has no adapter {adapter_name!r}; adapters: {available}")
    return adapter_name


def _jsonable(value: Any) -> Any:
    """Config values as plain JSON types: enums by value, sets as sorted lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _unwrapped_class(module: nn.Module) -> type:
    """The module's own class, not the FSDP2 subclass `fully_shard` swaps in."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def adapter_config(model: nn.Module, adapter_name: str | None = None) -> dict[str, Any]:
    """The adapter_config.json content PEFT's `save_pretrained` writes for this adapter.

    JSON types only (sets become sorted lists, so every rank gets the same
    dict), `inference_mode` true, `base_model_name_or_path` filled from the
    base model where PEFT would, and `auto_mapping` when there is no task_type.
    """
    peft_model = find_peft_model(model)
    adapter = resolve_adapter_name(peft_model, adapter_name)
    config = peft_model.peft_config[adapter].to_dict()
    base_model = peft_model.get_base_model()
    if config.get("base_model_name_or_path") is None:
        config["base_model_name_or_path"] = getattr(base_model, "name_or_path", None) or None
    config["inference_mode"] = True
    if config.get("task_type") is None:
        cls = _unwrapped_class(base_model)
        config["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    out: dict[str, Any] = _jsonable(config)
    return out


# --- which layers carry the adapter ------------------------------------------------


@dataclass(frozen=True)
class _Ref:
    """A parameter named by its owner and attribute, read when needed.

    FSDP2 swaps the registered tensor between the sharded DTensor and the
    unsharded one (the root stays unsharded after a forward without backward),
    so the tensor object is looked up at read time, never cached.
    """

    module: nn.Module
    attr: str

    def get(self) -> torch.Tensor:
        tensor = getattr(self.module, self.attr)
        assert isinstance(tensor, torch.Tensor), f"{self.attr} is not a tensor"
        return tensor


def _ref(model: nn.Module, trainer_name: str) -> _Ref:
    path, _, attr = trainer_name.rpartition(".")
    return _Ref(model.get_submodule(path) if path else model, attr)


@dataclass(frozen=True)
class _LoraTarget:
    """One LoRA'd layer of the chosen adapter."""

    hf_prefix: str
    """Checkpoint name of the wrapped module, e.g. "model.layers.0.mlp.up_proj"."""
    peft_prefix: str
    """Its prefix in PEFT's saved adapter, "base_model.model." + hf_prefix."""
    trainer_prefix: str
    """Its name in the trainer's module tree."""
    layer: LoraLayer
    adapter: str

    @property
    def is_embedding(self) -> bool:
        return isinstance(self.layer, LoraEmbedding)

    @property
    def has_lora_bias(self) -> bool:
        return bool(self.layer.lora_bias.get(self.adapter, False))

    @property
    def lora_A(self) -> _Ref:
        if self.is_embedding:
            return _Ref(self.layer.lora_embedding_A, self.adapter)
        return _Ref(self.layer.lora_A[self.adapter], "weight")

    @property
    def lora_B(self) -> _Ref:
        if self.is_embedding:
            return _Ref(self.layer.lora_embedding_B, self.adapter)
        return _Ref(self.layer.lora_B[self.adapter], "weight")

    @property
    def lora_B_bias(self) -> _Ref:
        return _Ref(self.layer.lora_B[self.adapter], "bias")

    def adapter_refs(self) -> list[tuple[str, _Ref]]:
        """(peft_name, ref) of its adapter tensors, in PEFT's state-dict order."""
        prefix = self.peft_prefix
        if self.is_embedding:
            return [(f"{prefix}.lora_embedding_A", self.lora_A), (f"{prefix}.lora_embedding_B", self.lora_B)]
        refs = [(f"{prefix}.lora_A.weight", self.lora_A), (f"{prefix}.lora_B.weight", self.lora_B)]
        if self.has_lora_bias:
            refs.append((f"{prefix}.lora_B.bias", self.lora_B_bias))
        return refs

    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """weight + this layer's delta, gathering A then B (collectives under FSDP2)."""
        scaling = self.layer.scaling[self.adapter]
        a, b = full_tensor(self.lora_A.get()), full_tensor(self.lora_B.get())
        if self.is_embedding:
            return merge_embedding(weight, a, b, scaling)
        return merge_linear(weight, a, b, scaling, fan_in_fan_out=bool(getattr(self.layer, "fan_in_fan_out", False)))

    def merged_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """bias + lora_B.bias * scaling (lora_bias=True)."""
        return merge_bias(bias, full_tensor(self.lora_B_bias.get()), self.layer.scaling[self.adapter])

    def merged_param(self, param: torch.Tensor) -> torch.Tensor:
        """A LoRA'd parameter (PEFT `target_parameters`, a `ParamWrapper`: a Mixture-of-Experts
        layer's fused experts) + its delta, computed by PEFT's own `get_delta_weight` (which
        reads the layer's A and B, unsharded: `_check_layer`), as PEFT's merge adds it
        (`param.data += delta`), out of place."""
        assert isinstance(self.layer, LoraParamWrapper)
        return param + self.layer.get_delta_weight(self.adapter)


def _check_config(peft_model: PeftModel, adapter: str, mode: str) -> None:
    config = peft_model.peft_config[adapter]
    peft_type = getattr(config, "peft_type", None)
    if peft_type != PeftType.LORA:
        raise ValueError(
            f"adapter {adapter!r} is a {getattr(peft_type, 'value', peft_type)} adapter; mode {mode!r} "
            f"supports {SUPPORTED}. Merge it into a plain model yourself and sync with mode='full'"
        )
    if getattr(config, "use_dora", False):
        raise ValueError(
            f"adapter {adapter!r} uses DoRA (use_dora=True), which mode {mode!r} does not support "
            f"yet; supported: {SUPPORTED}. Train with use_dora=False"
        )
    if getattr(config, "trainable_token_indices", None) is not None:
        raise ValueError(
            f"adapter {adapter!r} uses trainable_token_indices, which mode {mode!r} does not support; "
            f"supported: {SUPPORTED}"
        )
    bias = getattr(config, "bias", "none")
    if mode == "lora" and bias != "none":
        raise ValueError(
            f"adapter {adapter!r} trains base biases (bias={bias!r}); inference engines load "
            "adapters without them. Use bias='none', or mode='lora-merged' to send the trained biases"
        )


def _lora_targets(names: ModelNames, peft_model: PeftModel, adapter: str, mode: str) -> list[_LoraTarget]:
    """The layers holding `adapter`, checked against what `mode` supports."""
    _check_config(peft_model, adapter, mode)
    targets = []
    for found in names.adapter_layers:
        targets.extend(_check_layer(found, adapter, mode))
    if not targets:
        raise ValueError(f"adapter {adapter!r} has no LoRA layer in the model; nothing to sync")
    return targets


def _check_layer(found: AdapterLayer, adapter: str, mode: str) -> list[_LoraTarget]:
    layer = found.layer
    where = f"module {found.trainer_prefix!r} ({type(layer).__name__})"
    if not isinstance(layer, LoraLayer):
        raise ValueError(f"{where} is a non-LoRA PEFT tuner layer; mode {mode!r} supports {SUPPORTED}")
    if adapter not in layer.lora_A and adapter not in layer.lora_embedding_A:
        return []  # another adapter's layer
    if isinstance(layer, LoraParamWrapper):
        what = (f"{where}: LoRA on the parameter {layer.parameter_name!r} (PEFT target_parameters; on a "
                "Mixture-of-Experts layer, its fused experts)")
        if mode != "lora-merged":
            raise ValueError(f"{what} is not sent as an adapter: mode {mode!r} sends adapters on modules, which "
                             "is what engines load. Push mode='lora-merged', which merges it, or mode='full'")
        if is_dtensor(layer.lora_A[adapter].weight) or is_dtensor(layer.lora_B[adapter].weight):
            raise ValueError(f"{what} is sharded (FSDP2): mode 'lora-merged' merges it only unsharded. "
                             "Push mode='full', or put the adapter on attention and dense layers")
    if not isinstance(layer, LoraLinear | LoraEmbedding | LoraParamWrapper):
        raise ValueError(f"{where}: LoRA on this layer type is not supported; mode {mode!r} supports {SUPPORTED}")
    if isinstance(layer, LoraEmbedding) and mode == "lora":
        raise ValueError(
            f"{where}: adapters on embeddings are not sent in mode 'lora' (PEFT saves the whole "
            "embedding with them); leave embeddings out of target_modules, or use mode='lora-merged'"
        )
    if adapter in layer.lora_variant:
        variant = type(layer.lora_variant[adapter]).__name__
        raise ValueError(
            f"{where} uses the LoRA variant {variant} for adapter {adapter!r}, which mode {mode!r} "
            f"does not support yet; supported: {SUPPORTED}"
        )
    if mode == "lora-merged" and layer.merged:
        raise ValueError(
            f"{where} already has adapters {layer.merged_adapters} merged into its weights; "
            "call unmerge_adapter() first (merging a merged layer would add the delta twice)"
        )
    return [
        _LoraTarget(
            hf_prefix=found.hf_prefix,
            peft_prefix=found.peft_prefix,
            trainer_prefix=found.trainer_prefix,
            layer=layer,
            adapter=adapter,
        )
    ]


# --- the sources -------------------------------------------------------------------


class _PeftStream:
    """What both sources find first: the PEFT model, the adapter, the checkpoint
    names and the LoRA layers under that adapter (checked for `mode`)."""

    mode: str

    def __init__(self, model: nn.Module, *, adapter_name: str | None = None,
                 expert_layout: ExpertLayout | None = None) -> None:
        self.model = model
        self._peft_model = find_peft_model(model)
        self.adapter_name = resolve_adapter_name(self._peft_model, adapter_name)
        self._names = map_names(model, adapter_name=self.adapter_name, expert_layout=expert_layout)
        self._targets = _lora_targets(self._names, self._peft_model, self.adapter_name, self.mode)


class LoraSource(_PeftStream):
    """The adapter's tensors under PEFT's saved names ("lora" mode).

    Names are exactly the keys of `peft.get_peft_model_state_dict(model)`
    (and of `adapter_model.safetensors`): `base_model.model.<module>.lora_A.weight`,
    `.lora_B.weight` (`.lora_B.bias` with lora_bias), then the trained copies
    of `modules_to_save` as `base_model.model.<module>.<param>`; no adapter-name
    segment. For FSDP2 models `tensors()` gathers only these tensors, one at a
    time: every rank must call it with the same names in the same order.
    """

    mode = "lora"

    def __init__(self, model: nn.Module, *, adapter_name: str | None = None) -> None:
        super().__init__(model, adapter_name=adapter_name)
        self._refs: dict[str, _Ref] = {}
        for target in self._targets:
            self._refs.update(target.adapter_refs())
        for peft_name, ref in self._modules_to_save(self._names):
            self._refs[peft_name] = ref
        self._metas = [
            TensorMeta(hf_name=peft_name, dtype=ref.get().dtype, shape=global_shape(ref.get()))
            for peft_name, ref in self._refs.items()
        ]

    def _modules_to_save(self, names: ModelNames) -> list[tuple[str, _Ref]]:
        """The trained copies of `modules_to_save`, named as PEFT saves them."""
        copies: set[int] = set()
        for module in self._peft_model.modules():
            if isinstance(module, ModulesToSaveWrapper) and self.adapter_name in module.modules_to_save:
                copies.update(id(p) for p in module.modules_to_save[self.adapter_name].parameters())
        return [
            (f"base_model.model.{p.hf_name}", _ref(self.model, p.trainer_name))
            for p in names.params
            if id(p.param) in copies
        ]

    def metas(self) -> list[TensorMeta]:
        """PEFT name (in `hf_name`), dtype and full shape of every adapter tensor."""
        return list(self._metas)

    def config(self) -> dict[str, Any]:
        """adapter_config.json content (see `adapter_config`)."""
        return adapter_config(self._peft_model, self.adapter_name)

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(peft_name, tensor) in the order asked; unsharded tensors are the live ones, not copies."""
        for peft_name in self._refs if hf_names is None else hf_names:
            try:
                ref = self._refs[peft_name]
            except KeyError:
                raise KeyError(f"{peft_name!r} is not a tensor of adapter {self.adapter_name!r}") from None
            yield peft_name, full_tensor(ref.get())


class MergedLoraSource(_PeftStream):
    """Base weights with the adapter merged in, computed out of place ("lora-merged" mode).

    `metas()` is exactly `ModuleSource(model).metas()`: checkpoint names,
    dtypes and shapes of the base model; adapter tensors are not sent. A
    weight under LoRA comes out as a new tensor, W + delta, bit-equal to what
    PEFT's `merge_and_unload()` leaves in it; every other weight is yielded
    as is (the live tensor, not a copy, when unsharded).

    Memory: one weight at a time. Under FSDP2, for each name asked, W is
    gathered, then that layer's A and B, the delta is computed and added,
    and the gathered inputs are dropped before the next name: about three
    times the largest weight beyond the model. Every rank must call
    `tensors()` with the same names in the same order.
    """

    mode = "lora-merged"

    def __init__(self, model: nn.Module, *, adapter_name: str | None = None,
                 expert_layout: ExpertLayout = "per-expert") -> None:
        super().__init__(model, adapter_name=adapter_name, expert_layout=expert_layout)
        names, targets = self._names, self._targets
        self._refs = {p.hf_name: (_ref(model, p.trainer_name), p.expert) for p in names.params}
        self._metas = [
            TensorMeta(hf_name=p.hf_name, dtype=p.param.dtype,
                       shape=p.expert.shape(global_shape(p.param)) if p.expert else global_shape(p.param))
            for p in names.params
        ]
        # Which weights each layer modifies, found by identity (a tied weight is one
        # Parameter under one hf_name; two layers on it merge in module order, as PEFT does).
        # LoRA on a parameter (a PEFT ParamWrapper: fused experts) merges into every name of that
        # parameter: the fused tensor, or each expert's view of the merged fused tensor.
        hf_name_of = {id(p.param): p.hf_name for p in names.params if p.expert is None}
        self._merges: dict[str, list[tuple[_LoraTarget, str]]] = {}
        on_params: dict[int, list[_LoraTarget]] = {}
        for target in targets:
            if isinstance(target.layer, LoraParamWrapper):
                on_params.setdefault(id(target.layer.get_param()), []).append(target)
                continue
            base = target.layer.get_base_layer()
            parts = ["weight", "bias"] if target.has_lora_bias else ["weight"]
            for part in parts:
                param = getattr(base, part, None)
                if param is None:
                    raise ValueError(
                        f"module {target.trainer_prefix!r} has lora_bias=True but its base layer has no "
                        f"{part}; PEFT cannot merge it either"
                    )
                hf_name = hf_name_of.get(id(param))
                assert hf_name is not None, f"base {part} of {target.trainer_prefix!r} was not named"
                self._merges.setdefault(hf_name, []).append((target, part))
        self._param_merges = {p.hf_name: on_params[id(p.param)] for p in names.params if id(p.param) in on_params}
        """hf_name -> the ParamWrapper targets on the (fused) parameter it is, or is a view of."""
        logger.debug(
            "lora-merged source: %d weights, %d under adapter %r",
            len(self._metas), len(self._merges), self.adapter_name,
        )

    def metas(self) -> list[TensorMeta]:
        """Checkpoint name, dtype and full shape of every base weight."""
        return list(self._metas)

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, merged weight) in the order asked; the trainer's tensors are never written."""
        gathered: tuple[_Ref, torch.Tensor] | None = None  # a fused expert parameter, for its run of experts
        for hf_name in self._refs if hf_names is None else hf_names:
            if hf_name not in self._refs:
                raise KeyError(f"{hf_name!r} is not a weight of this model")
            ref, expert = self._refs[hf_name]
            if expert is None:
                gathered = None
                yield hf_name, self._merged(hf_name)
                continue
            if gathered is None or gathered[0] != ref:
                gathered = None
                gathered = (ref, self._merged_param(hf_name, full_tensor(ref.get())))
            yield hf_name, expert.of(gathered[1])

    @torch.no_grad()
    def _merged(self, hf_name: str) -> torch.Tensor:
        tensor = full_tensor(self._refs[hf_name][0].get())
        for target, part in self._merges.get(hf_name, ()):
            tensor = target.merged_weight(tensor) if part == "weight" else target.merged_bias(tensor)
        return self._merged_param(hf_name, tensor)

    @torch.no_grad()
    def _merged_param(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (the parameter `hf_name` is, or is one expert of) with the LoRA on that
        parameter merged (PEFT target_parameters); itself when there is none."""
        for target in self._param_merges.get(hf_name, ()):
            tensor = target.merged_param(tensor)
        return tensor
