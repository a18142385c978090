"""LoRA merge math: one layer's weight delta, and W + delta, out of place.

Pure: tensors and numbers in, new tensors out; knows no modules, PEFT objects, names or collectives
(the caller, `lora.source.MergedLoraSource`, gathers the tensors). Mirrors PEFT v0.21's
`get_delta_weight` and merge operation for operation, so the result is bit-equal to
`merge_and_unload()`, and never writes the input weight. The PEFT operations it mirrors:
docs/ARCHITECTURE.md ("Design notes").
"""

from __future__ import annotations

import math

import torch

_HALF_DTYPES = (torch.float16, torch.bfloat16)


def lora_scaling(r: int, lora_alpha: float, *, use_rslora: bool = False) -> float:
    """The factor LoRA multiplies B @ A by: lora_alpha / r, or lora_alpha / sqrt(r) with rslora."""
    if r <= 0:
        raise ValueError(f"LoRA rank r must be positive, got {r}")
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def _upcast_on_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    """PEFT computes half-precision deltas in float32 when the adapter lives on the CPU."""
    return device.type == "cpu" and dtype in _HALF_DTYPES


def linear_delta(
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    *,
    fan_in_fan_out: bool = False,
) -> torch.Tensor:
    """scaling * B @ A for a LoRA'd `nn.Linear` (or transposed for a Conv1D-style weight).

    `lora_A` is (r, in_features), `lora_B` is (out_features, r); the result has
    the base weight's shape, (out, in), or (in, out) with `fan_in_fan_out`. Its
    dtype is B's dtype, as in PEFT.
    """
    if lora_A.ndim != 2 or lora_B.ndim != 2 or lora_B.shape[1] != lora_A.shape[0]:
        raise ValueError(
            f"LoRA shapes do not chain: lora_B {tuple(lora_B.shape)} @ lora_A {tuple(lora_A.shape)}; "
            "expected (out, r) @ (r, in)"
        )
    dtype = lora_B.dtype
    upcast = _upcast_on_cpu(lora_B.device, dtype)
    weight_A, weight_B = (lora_A.float(), lora_B.float()) if upcast else (lora_A, lora_B)
    product = weight_B @ weight_A
    if fan_in_fan_out:
        product = product.T
    delta = product.mul_(scaling)  # in place on our own temporary: same bits, one buffer fewer
    return delta.to(dtype=dtype) if upcast else delta


def embedding_delta(
    lora_embedding_A: torch.Tensor,
    lora_embedding_B: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """scaling * (B @ A).T for a LoRA'd `nn.Embedding`.

    `lora_embedding_A` is (r, num_embeddings), `lora_embedding_B` is
    (embedding_dim, r); the result is (num_embeddings, embedding_dim) in A's
    dtype, as in PEFT.
    """
    if (
        lora_embedding_A.ndim != 2
        or lora_embedding_B.ndim != 2
        or lora_embedding_B.shape[1] != lora_embedding_A.shape[0]
    ):
        raise ValueError(
            f"LoRA embedding shapes do not chain: lora_embedding_B {tuple(lora_embedding_B.shape)} "
            f"@ lora_embedding_A {tuple(lora_embedding_A.shape)}; expected (dim, r) @ (r, num_embeddings)"
        )
    dtype = lora_embedding_A.dtype
    upcast = _upcast_on_cpu(lora_embedding_B.device, dtype)
    weight_A = lora_embedding_A.float() if upcast else lora_embedding_A
    weight_B = lora_embedding_B.float() if upcast else lora_embedding_B
    delta = (weight_B @ weight_A).T.mul_(scaling)
    return delta.to(dtype=dtype) if upcast else delta


def merge_weight(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A new tensor holding weight + delta, rounded exactly as PEFT's in-place merge.

    The result has `weight`'s dtype, shape and device; `weight` is not written.
    """
    if tuple(delta.shape) != tuple(weight.shape):
        raise ValueError(f"LoRA delta shape {tuple(delta.shape)} does not match the weight's {tuple(weight.shape)}")
    merged = weight.clone()
    merged += delta
    return merged


def _add_weight_into(delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight + delta, reusing `delta`'s memory when that gives the same bits.

    Only for a `delta` the caller owns. Addition is commutative, so `delta +=
    weight` equals PEFT's `weight += delta` whenever delta's dtype is the one
    the sum is computed in; the cast back to the weight's dtype rounds once,
    as the in-place merge does.
    """
    if (
        delta.is_contiguous()
        and tuple(delta.shape) == tuple(weight.shape)
        and torch.promote_types(delta.dtype, weight.dtype) == delta.dtype
    ):
        delta += weight
        return delta.to(dtype=weight.dtype)
    return merge_weight(weight, delta)


def merge_linear(
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    *,
    fan_in_fan_out: bool = False,
) -> torch.Tensor:
    """`merge_weight(weight, linear_delta(...))` with one weight-sized temporary instead of two."""
    return _add_weight_into(linear_delta(lora_A, lora_B, scaling, fan_in_fan_out=fan_in_fan_out), weight)


def merge_embedding(
    weight: torch.Tensor,
    lora_embedding_A: torch.Tensor,
    lora_embedding_B: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """`merge_weight(weight, embedding_delta(...))` with one weight-sized temporary instead of two."""
    return _add_weight_into(embedding_delta(lora_embedding_A, lora_embedding_B, scaling), weight)


def merge_bias(bias: torch.Tensor, lora_B_bias: torch.Tensor, scaling: float) -> torch.Tensor:
    """A new tensor holding bias + lora_B.bias * scaling (PEFT's `lora_bias=True` merge)."""
    return merge_weight(bias, lora_B_bias * scaling)
