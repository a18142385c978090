"""The pure merge math against PEFT's own layers, bit for bit (milliseconds, CPU)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers.pytorch_utils import Conv1D

from weightsync.lora.merge import (
    embedding_delta,
    linear_delta,
    lora_scaling,
    merge_bias,
    merge_embedding,
    merge_linear,
    merge_weight,
)


def _randomise(layer: nn.Module, seed: int) -> None:
    """Every LoRA tensor non-zero (PEFT initialises B to zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "lora" in name:
                p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))


class _Toy(nn.Module):
    def __init__(self, proj: nn.Module) -> None:
        super().__init__()
        self.proj = proj


def _lora_layer(base: nn.Module, dtype: torch.dtype, adapter_dtype: torch.dtype | None = None,
                **lora: object) -> nn.Module:
    """PEFT's LoRA layer around `base` in `dtype`, built the public way, adapters in `adapter_dtype`."""
    toy = _Toy(base.to(dtype))
    config = LoraConfig(target_modules=["proj"], r=4, lora_alpha=8, lora_dropout=0.1, **lora)  # type: ignore[arg-type]
    layer = get_peft_model(toy, config, autocast_adapter_dtype=False).base_model.model.proj
    for name, p in layer.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype or dtype)
    _randomise(layer, 1)
    return layer


def _lora_linear(dtype: torch.dtype, *, fan_in_fan_out: bool = False, use_rslora: bool = False,
                 lora_bias: bool = False) -> nn.Module:
    torch.manual_seed(0)
    base = Conv1D(24, 16) if fan_in_fan_out else nn.Linear(16, 24)
    return _lora_layer(base, dtype, fan_in_fan_out=fan_in_fan_out, use_rslora=use_rslora, lora_bias=lora_bias)


def _peft_merged(layer: nn.Module) -> dict[str, torch.Tensor]:
    """What PEFT's (unsafe, default) merge leaves in the base layer (of a copy: unmerge is not exact)."""
    layer = copy.deepcopy(layer)
    layer.merge()
    return layer.get_base_layer().state_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("fan_in_fan_out", [False, True])
def test_linear_merge_is_bit_equal_to_peft(dtype: torch.dtype, use_rslora: bool, fan_in_fan_out: bool) -> None:
    layer = _lora_linear(dtype, fan_in_fan_out=fan_in_fan_out, use_rslora=use_rslora)
    a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    weight = layer.get_base_layer().weight.detach()
    original = weight.clone()
    scaling = lora_scaling(4, 8, use_rslora=use_rslora)
    assert scaling == layer.scaling["default"]

    delta = linear_delta(a, b, scaling, fan_in_fan_out=fan_in_fan_out)
    assert torch.equal(delta, layer.get_delta_weight("default"))
    assert delta.dtype == dtype and delta.abs().sum() > 0
    merged = merge_weight(weight, delta)
    expected = _peft_merged(layer)["weight"]
    assert merged.dtype == expected.dtype and torch.equal(merged, expected)
    fused = merge_linear(weight, a, b, scaling, fan_in_fan_out=fan_in_fan_out)
    assert fused.dtype == expected.dtype and torch.equal(fused, expected)
    assert torch.equal(weight, original), "the merge wrote its input"


@pytest.mark.parametrize(
    ("dtype", "adapter_dtype"),
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16)],
)
def test_mixed_dtype_merge_is_bit_equal_to_peft(dtype: torch.dtype, adapter_dtype: torch.dtype) -> None:
    # get_peft_model's default keeps adapters in float32 on a bfloat16 base.
    torch.manual_seed(0)
    layer = _lora_layer(nn.Linear(16, 24), dtype, adapter_dtype)
    a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    weight = layer.get_base_layer().weight.detach()
    original = weight.clone()
    expected = _peft_merged(layer)["weight"]
    for merged in (merge_weight(weight, linear_delta(a, b, 2.0)), merge_linear(weight, a, b, 2.0)):
        assert merged.dtype == dtype and torch.equal(merged, expected)
    assert torch.equal(weight, original)


def test_lora_bias_merge_is_bit_equal_to_peft() -> None:
    layer = _lora_linear(torch.float32, lora_bias=True)
    bias = layer.get_base_layer().bias.detach()
    original = bias.clone()
    merged = merge_bias(bias, layer.lora_B["default"].bias.detach(), layer.scaling["default"])
    assert torch.equal(merged, _peft_merged(layer)["bias"])
    assert not torch.equal(merged, original) and torch.equal(bias, original)


def test_mixed_dtypes_round_like_the_in_place_merge() -> None:
    # PEFT's default keeps adapters in float32 on a bfloat16 base: the add happens in float32.
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(32, 16, generator=gen).bfloat16()
    delta = torch.randn(32, 16, generator=gen) * 1e-2
    in_place = weight.clone()
    in_place += delta
    merged = merge_weight(weight, delta)
    assert merged.dtype == torch.bfloat16 and torch.equal(merged, in_place)
    # Rounding the delta first (what safe_merge does) gives different bits.
    assert not torch.equal(merged, weight + delta.bfloat16())


def test_half_precision_delta_is_computed_in_float32_on_cpu() -> None:
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(8, 256, generator=gen).bfloat16()
    b = torch.randn(256, 8, generator=gen).bfloat16()
    delta = linear_delta(a, b, 0.7)
    assert delta.dtype == torch.bfloat16
    assert torch.equal(delta, ((b.float() @ a.float()) * 0.7).bfloat16())
    assert not torch.equal(delta, (b @ a) * 0.7), "the float32 upcast must change some bits"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_merge_is_bit_equal_to_peft(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layer = _lora_layer(nn.Embedding(40, 16), dtype, use_rslora=True)
    a, b = layer.lora_embedding_A["default"].detach(), layer.lora_embedding_B["default"].detach()
    delta = embedding_delta(a, b, layer.scaling["default"])
    assert delta.shape == (40, 16) and torch.equal(delta, layer.get_delta_weight("default"))
    weight = layer.get_base_layer().weight.detach()
    expected = _peft_merged(layer)["weight"]
    assert torch.equal(merge_weight(weight, delta), expected)
    assert torch.equal(merge_embedding(weight, a, b, layer.scaling["default"]), expected)


def test_scaling() -> None:
    assert lora_scaling(16, 32) == 2.0
    assert lora_scaling(16, 32, use_rslora=True) == 8.0
    assert lora_scaling(8, 16, use_rslora=True) == 16 / math.sqrt(8)
    assert LoraConfig(r=8, lora_alpha=16).lora_alpha / 8 == lora_scaling(8, 16)
    with pytest.raises(ValueError, match="rank r must be positive"):
        lora_scaling(0, 16)


def test_shape_errors_name_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"lora_B \(8, 3\) @ lora_A \(4, 16\)"):
        linear_delta(torch.zeros(4, 16), torch.zeros(8, 3), 1.0)
    with pytest.raises(ValueError, match=r"delta shape \(8, 16\) does not match the weight's \(16, 8\)"):
        merge_weight(torch.zeros(16, 8), torch.zeros(8, 16))
    with pytest.raises(ValueError, match="embedding shapes do not chain"):
        embedding_delta(torch.zeros(4, 10), torch.zeros(8, 5), 1.0)


def test_awkward_tensors() -> None:
    # Non-contiguous inputs and an empty layer.
    a = torch.randn(16, 4).T
    b = torch.randn(8, 12)[:, ::3]
    assert not a.is_contiguous() and not b.is_contiguous()
    assert torch.equal(linear_delta(a, b, 2.0), (b.contiguous() @ a.contiguous()) * 2.0)
    empty = linear_delta(torch.zeros(4, 0), torch.zeros(8, 4), 1.0)
    assert empty.shape == (8, 0)
    assert merge_weight(torch.zeros(8, 0), empty).shape == (8, 0)
