"""LoRA adapters on the served model: checks, an LRU store, per-request routing.

An adapter arrives as PEFT's saved tensors (`peft_name`s `base_model.model.<module path>.lora_A.weight`,
no adapter-name segment) plus its adapter_config.json, and is applied as PEFT's `lora.Linear.forward`
computes it, to the requests that name it. `server/updates.py` loads adapters into the store
(`LoraStore`) and the runner activates a request's adapter; the trainer's side is `weightsync.lora`.
The math, dtypes, what is refused, eviction: docs/ARCHITECTURE.md, "Design notes, by module".
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weightsync.bucketing import layout_bucket
from weightsync.errors import ManifestMismatchError, SyncTimeoutError
from weightsync.integrity import check_manifest_fits
from weightsync.manifest import Manifest, TensorMeta
from weightsync.server.errors import ConflictError, NotFoundError

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
_A_SUFFIX = ".lora_A.weight"
_B_SUFFIX = ".lora_B.weight"
# Config options that change the forward pass in ways this engine does not implement.
_REFUSED_OPTIONS = {
    "use_dora": "DoRA (use_dora=True)",
    "modules_to_save": "modules_to_save",
    "lora_bias": "LoRA bias (lora_bias=True)",
    "fan_in_fan_out": "fan_in_fan_out=True (Conv1D layers)",
    "target_parameters": "target_parameters",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora=True)",
    "use_bdlora": "use_bdlora",
    "target_modules_to_tie": "target_modules_to_tie",
}
_ticks = itertools.count()


def parse_config(config_dict: Mapping[str, Any]) -> Any:
    """adapter_config.json -> peft.LoraConfig; refuses what the engine cannot apply."""
    from peft import LoraConfig

    if not isinstance(config_dict, Mapping):
        raise ValueError("the LoRA config must be a JSON object (adapter_config.json contents)")
    peft_type = config_dict.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"peft_type {peft_type!r} is not supported; only LORA adapters load here")
    refused = [label for key, label in _REFUSED_OPTIONS.items() if config_dict.get(key)]
    if config_dict.get("bias", "none") != "none":
        refused.append(f"bias={config_dict.get('bias')!r}")
    if refused:
        raise ValueError(f"unsupported LoRA option(s): {', '.join(refused)}")
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    kwargs = {k: v for k, v in config_dict.items() if k in known and k not in ("peft_type", "runtime_config")}
    try:
        config = LoraConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid LoRA config: {e}") from None
    if not config.target_modules:
        raise ValueError("the LoRA config has no target_modules")
    return config


def split_peft_name(peft_name: str) -> tuple[str, str]:
    """`base_model.model.<path>.lora_A.weight` -> (<path>, "lora_A"); ValueError otherwise."""
    if peft_name.startswith(PEFT_PREFIX):
        for suffix, kind in ((_A_SUFFIX, "lora_A"), (_B_SUFFIX, "lora_B")):
            if peft_name.endswith(suffix) and len(peft_name) > len(PEFT_PREFIX) + len(suffix):
                return peft_name[len(PEFT_PREFIX) : -len(suffix)], kind
    if "lora_embedding_" in peft_name:
        raise ValueError(f"{peft_name!r}: LoRA on embedding layers is not supported (only nn.Linear targets)")
    if "lora_magnitude_vector" in peft_name:
        raise ValueError(f"{peft_name!r}: DoRA weights are not supported")
    raise ValueError(
        f"{peft_name!r} is not a PEFT LoRA weight name; expected "
        f"'{PEFT_PREFIX}<module>{_A_SUFFIX}' or '...{_B_SUFFIX}'"
    )


def _target_modules(model: nn.Module, config: Any) -> dict[str, nn.Linear]:
    """The modules `config` targets in `model`; non-Linear targets are refused."""
    from peft.tuners.tuners_utils import check_target_module_exists

    all_linear = isinstance(config.target_modules, str) and config.target_modules == "all-linear"
    get_output = getattr(model, "get_output_embeddings", None)
    output_layer = get_output() if callable(get_output) else None
    targets: dict[str, nn.Linear] = {}
    unsupported: list[str] = []
    for path, module in model.named_modules():
        if not path:
            continue
        if all_linear:
            hit = isinstance(module, nn.Linear) and module is not output_layer
        else:
            hit = bool(check_target_module_exists(config, path))
        if not hit:
            continue
        if type(module) is nn.Linear:
            targets[path] = module
        else:
            unsupported.append(f"{path} ({type(module).__name__})")
    if unsupported:
        raise ValueError(f"unsupported LoRA target layer type(s), only nn.Linear: {', '.join(unsupported[:8])}")
    if not targets:
        raise ValueError(f"target_modules {config.target_modules!r} match no module of the served model")
    return targets


def _rank_and_alpha(config: Any, path: str) -> tuple[int, float]:
    from peft.utils.other import get_pattern_key

    rank_pattern = config.rank_pattern or {}
    alpha_pattern = config.alpha_pattern or {}
    r = rank_pattern.get(get_pattern_key(list(rank_pattern), path), config.r)
    alpha = alpha_pattern.get(get_pattern_key(list(alpha_pattern), path), config.lora_alpha)
    return int(r), float(alpha)


def expected_metas(model: nn.Module, config: Any, sent: Mapping[str, TensorMeta]) -> dict[str, TensorMeta]:
    """peft_name -> the shape every LoRA tensor of `config` must have on this model.

    dtypes: any floating dtype is accepted (the adapter is cast to float32),
    so the expected dtype is the sent one where that is floating point.
    """
    expected: dict[str, TensorMeta] = {}
    for path, linear in _target_modules(model, config).items():
        r, _ = _rank_and_alpha(config, path)
        for kind, shape in (("lora_A", (r, linear.in_features)), ("lora_B", (linear.out_features, r))):
            peft_name = f"{PEFT_PREFIX}{path}.{kind}.weight"
            got = sent.get(peft_name)
            dtype = got.dtype if got is not None and got.dtype.is_floating_point else torch.float32
            expected[peft_name] = TensorMeta(hf_name=peft_name, dtype=dtype, shape=shape)
    return expected


def check_adapter(model: nn.Module, config: Any, sent: Mapping[str, TensorMeta], *, lora_name: str) -> None:
    """Dry run: every target has lora_A and lora_B of the right shapes, nothing else is sent.

    Raises ValueError for malformed names or options, ManifestMismatchError
    naming missing, unexpected and mismatched tensors.
    """
    expected = expected_metas(model, config, sent)  # first: refuses unsupported target layers by type
    for peft_name in sent:
        split_peft_name(peft_name)
    probe = Manifest(version=0, mode="lora", lora_name=lora_name,
                     buckets=(layout_bucket(0, list(sent.values())),))
    try:
        check_manifest_fits(probe, expected, partial=False)
    except ManifestMismatchError as e:
        message = str(e).replace("update v0 refused before any byte moved", f"LoRA adapter {lora_name!r} refused")
        raise ManifestMismatchError(message, missing=e.missing, unexpected=e.unexpected,
                                    mismatched=e.mismatched) from None


@dataclass(frozen=True)
class LoraWeights:
    """One target module's adapter: lora_A (r, in), lora_B (out, r), float32."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float


@dataclass(eq=False)
class Adapter:
    """A loaded adapter and its bookkeeping (guarded by the store's lock)."""

    name: str
    modules: dict[str, LoraWeights]
    config: dict[str, Any]
    pinned: bool = False
    in_flight: int = 0
    retiring: bool = False
    last_used: int = field(default_factory=lambda: next(_ticks))


def build_adapter(model: nn.Module, name: str, config_dict: Mapping[str, Any],
                  tensors: Mapping[str, torch.Tensor]) -> Adapter:
    """Check and copy an adapter's tensors (float32) into an `Adapter`; nothing is loaded yet."""
    config = parse_config(config_dict)
    check_adapter(model, config, {n: TensorMeta.of(n, t) for n, t in tensors.items()}, lora_name=name)
    param_dtype = next(model.parameters()).dtype
    store_dtype = torch.promote_types(param_dtype, torch.float32)
    modules: dict[str, LoraWeights] = {}
    for path in _target_modules(model, config):
        r, alpha = _rank_and_alpha(config, path)
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        a = tensors[f"{PEFT_PREFIX}{path}{_A_SUFFIX}"].detach().to(store_dtype, copy=True).contiguous()
        b = tensors[f"{PEFT_PREFIX}{path}{_B_SUFFIX}"].detach().to(store_dtype, copy=True).contiguous()
        modules[path] = LoraWeights(lora_A=a, lora_B=b, scaling=scaling)
    return Adapter(name=name, modules=modules, config=dict(config_dict))


class LoraStore:
    """The loaded adapters, least recently used first, and the forward hooks that apply them."""

    def __init__(self, model: nn.Module, *, max_loaded: int) -> None:
        if max_loaded < 1:
            raise ValueError(f"max_loaded_loras must be at least 1, got {max_loaded}")
        self.model = model
        self.max_loaded = max_loaded
        self._adapters: OrderedDict[str, Adapter] = OrderedDict()
        self._cond = threading.Condition()
        self._active: Adapter | None = None
        for path, module in model.named_modules():
            if type(module) is nn.Linear:
                module.register_forward_hook(self._make_hook(path))

    def _make_hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
            adapter = self._active
            weights = adapter.modules.get(path) if adapter is not None else None
            if weights is None:
                return None
            x = args[0].to(weights.lora_A.dtype)
            result = output + F.linear(F.linear(x, weights.lora_A), weights.lora_B) * weights.scaling
            return result.to(output.dtype)

        return hook

    @contextlib.contextmanager
    def activate(self, adapter: Adapter | None) -> Iterator[None]:
        """Apply `adapter` (None: the base model) to forwards inside the block. Scheduler thread only."""
        self._active = adapter
        try:
            yield
        finally:
            self._active = None

    def names(self) -> list[str]:
        with self._cond:
            return [a.name for a in self._adapters.values() if not a.retiring]

    def is_loaded(self, name: str) -> bool:
        with self._cond:
            adapter = self._adapters.get(name)
            return adapter is not None and not adapter.retiring

    def add(self, adapter: Adapter, *, pinned: bool = False) -> list[Adapter]:
        """Load `adapter`, evicting least recently used ones beyond the limit; returns those evicted."""
        with self._cond:
            if adapter.name in self._adapters:
                raise ConflictError(f"LoRA adapter {adapter.name!r} is already loaded; unload it first")
            evicted = []
            while len(self._adapters) >= self.max_loaded:
                victim = next((a for a in self._adapters.values()
                               if not a.pinned and a.in_flight == 0 and not a.retiring), None)
                if victim is None:
                    raise ConflictError(
                        f"cannot load {adapter.name!r}: all {len(self._adapters)} loaded adapters "
                        f"(limit {self.max_loaded}) are pinned or in use; unload one"
                    )
                del self._adapters[victim.name]
                evicted.append(victim)
                log.info("evicted LoRA adapter %s (least recently used)", victim.name)
            adapter.pinned = pinned
            self._adapters[adapter.name] = adapter
            return evicted

    def acquire(self, name: str) -> Adapter:
        """Take a reference for a request; raises NotFoundError for an unknown name."""
        with self._cond:
            adapter = self._adapters.get(name)
            if adapter is None or adapter.retiring:
                raise NotFoundError(f"LoRA adapter {name!r} is not loaded; loaded: {self.names_locked()}")
            adapter.in_flight += 1
            adapter.last_used = next(_ticks)
            self._adapters.move_to_end(name)
            return adapter

    def names_locked(self) -> list[str]:
        return [a.name for a in self._adapters.values() if not a.retiring]

    def release(self, adapter: Adapter) -> None:
        with self._cond:
            adapter.in_flight -= 1
            assert adapter.in_flight >= 0, f"adapter {adapter.name} released more often than acquired"
            self._cond.notify_all()

    def unload(self, name: str, *, timeout_s: float) -> None:
        """Unload `name` once no request uses it (new requests are refused meanwhile)."""
        with self._cond:
            adapter = self._adapters.get(name)
            if adapter is None or adapter.retiring:
                raise NotFoundError(f"LoRA adapter {name!r} is not loaded; loaded: {self.names_locked()}")
            adapter.retiring = True
            if not self._cond.wait_for(lambda: adapter.in_flight == 0, timeout=timeout_s):
                adapter.retiring = False
                raise SyncTimeoutError(
                    f"LoRA adapter {name!r} still has {adapter.in_flight} request(s) after {timeout_s:.0f}s; "
                    "not unloaded"
                )
            del self._adapters[name]
