"""weightsync's quantizers against compressed-tensors 0.17 (the library vLLM loads these
checkpoints with), bit for bit, and the peers' block quantizers where they round otherwise."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from weightsync.errors import CastError
from weightsync.formats.quantized import (
    FP8_BLOCK,
    INT8_CHANNEL,
    QuantFormat,
    format_from_config,
    quantize_fp8_block,
    quantize_int8_channel,
)

INT8_ARGS = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
FP8_ARGS = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128])


def _ct_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' channel quantization of float32 `w`: the observer's per-row min/max, then
    `calculate_qparams` and `quantize`."""
    scale, zp = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), INT8_ARGS)
    return ct_quantize(w, scale, zp, INT8_ARGS, dtype=torch.int8), scale


def _ct_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' block quantization of float32 `w`: per-block min/max over the
    zero-padded weight, then `calculate_qparams` and `quantize` (which pads and cuts itself)."""
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, (-cols) % 128, 0, (-rows) % 128))
    blocks = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    scale, zp = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), FP8_ARGS)
    return ct_quantize(w, scale, zp, FP8_ARGS, dtype=torch.float8_e4m3fn), scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _weights(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[0, : shape[1] // 2] *= 40  # a row (and block) with outliers
    return w


@pytest.mark.parametrize("shape", [(64, 96), (130, 257), (1, 1), (7, 300)])
def test_int8_channel_equals_compressed_tensors_bit_for_bit(shape: tuple[int, int]) -> None:
    w = _weights(shape, seed=sum(shape))
    w[-1] = 0.0  # an all-zero row: the scale is float32's eps, the row 0
    q, scale = quantize_int8_channel(w)
    ref_q, ref_scale = _ct_int8(w)
    assert q.dtype == ref_q.dtype == torch.int8 and scale.dtype == ref_scale.dtype == torch.float32
    assert scale.shape == (shape[0], 1)
    assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(_bits(scale), _bits(ref_scale))
    assert scale[-1].item() == torch.finfo(torch.float32).eps and not q[-1].any()


def test_int8_channel_uses_minus_128_and_ties_to_even() -> None:
    # scale = amax / 127.5: -amax lands on -127.5, rounded half to even -> -128; +amax clamps to 127
    w = torch.tensor([[127.5, -127.5, 0.5, 1.5, 2.5]])
    q, scale = quantize_int8_channel(w)
    assert scale.item() == 1.0
    assert q.tolist() == [[127, -128, 0, 2, 2]]  # 0.5 -> 0, 1.5 -> 2, 2.5 -> 2: ties to even
    assert torch.equal(q, _ct_int8(w)[0])


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (128, 1), (3, 129)])
def test_fp8_block_equals_compressed_tensors_bit_for_bit(shape: tuple[int, int]) -> None:
    w = _weights(shape, seed=sum(shape))
    if shape[0] > 128:
        w[128:, :128] = 0.0  # an all-zero block (a partial one where the weight is not a multiple of 128)
    q, scale = quantize_fp8_block(w)
    ref_q, ref_scale = _ct_fp8(w)
    assert q.dtype == ref_q.dtype == torch.float8_e4m3fn and scale.dtype == ref_scale.dtype == torch.float32
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128)) == tuple(ref_scale.shape)
    assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(_bits(scale), _bits(ref_scale))
    if shape[0] > 128:
        assert scale[1, 0].item() == torch.finfo(torch.float32).eps
        assert not q[128:, :128].float().any()
    assert torch.isfinite(q.float()).all()


def _reciprocal_peer(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The verl / NeMo-RL rounding (`scaled_fp8_blockwise`, `cast_tensor_to_fp8_blockwise`), as read
    from their sources: scale_fp = 448 / amax (1.0 for a zero block), q = clamp(w * scale_fp) cast,
    scale_inv = 1 / scale_fp. Written here for shapes that are multiples of 128."""
    rows, cols = w.shape
    blocks = w.reshape(rows // 128, 128, cols // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scale_fp = torch.where(amax == 0, torch.tensor(1.0), 448.0 / amax)
    q = torch.clamp(blocks * scale_fp, -448.0, 448.0).to(torch.float8_e4m3fn).reshape(rows, cols)
    return q, torch.reciprocal(scale_fp).reshape(rows // 128, cols // 128)


def test_fp8_block_differs_from_the_reciprocal_peers_where_said() -> None:
    """Where verl's and NeMo-RL's multiply-by-reciprocal rounds otherwise (docs/QUANTIZED.md): the
    scale differs by an ulp in some blocks, and a zero block's scale is 1.0 where ours is eps. The
    dequantized weights stay within one e4m3 step of each other."""
    w = _weights((512, 512), seed=7)
    w[:128, :128] = 0.0
    q, scale = quantize_fp8_block(w)
    peer_q, peer_scale = _reciprocal_peer(w)
    assert peer_scale[0, 0].item() == 1.0 and scale[0, 0].item() == torch.finfo(torch.float32).eps
    differs = (_bits(scale) != _bits(peer_scale)).view(torch.uint8)
    assert 0 < int(differs.sum()) < scale.numel() * 4  # a few blocks' scales, by an ulp
    fmt = QuantFormat(kind=FP8_BLOCK, scale_suffix="weight_scale_inv", block=(128, 128))
    ours, theirs = fmt.dequantize(q, scale), fmt.dequantize(peer_q, peer_scale)
    assert torch.equal(ours[:128, :128], theirs[:128, :128])  # zeros either way
    assert ((ours - theirs).abs() <= (w.abs() / 8 + 1e-12)).all()


def test_dequantize_is_what_the_engine_computes() -> None:
    w = _weights((130, 257), seed=3)
    for fmt in (QuantFormat(kind=INT8_CHANNEL, scale_suffix="weight_scale"),
                QuantFormat(kind=FP8_BLOCK, scale_suffix="weight_scale_inv", block=(128, 128))):
        q, scale = fmt.quantize(w)
        assert fmt.scale_shape(w.shape) == tuple(scale.shape)
        back = fmt.dequantize(q, scale)
        step = scale.max().item() * (1.0 if fmt.block is None else 32.0)  # an int8 step; an e4m3 step at 448
        assert (back - w).abs().max().item() <= step


def test_dequantized_columns_are_those_of_the_whole_dequantized_weight() -> None:
    """What the vLLM probe compares with: a few columns (across partial edge blocks too), bit for bit."""
    w = _weights((300, 400), seed=4)
    columns = torch.tensor([0, 1, 127, 128, 255, 256, 383, 399])
    for fmt in (QuantFormat(kind=INT8_CHANNEL, scale_suffix="weight_scale"),
                QuantFormat(kind=FP8_BLOCK, scale_suffix="weight_scale_inv", block=(128, 128))):
        q, scale = fmt.quantize(w)
        assert torch.equal(fmt.dequantize_columns(q, scale, columns), fmt.dequantize(q, scale)[:, columns])


def test_bfloat16_weights_are_quantized_from_their_float32_values() -> None:
    w = _weights((64, 64), seed=1).to(torch.bfloat16)
    fmt = QuantFormat(kind=INT8_CHANNEL, scale_suffix="weight_scale")
    q, scale = fmt.quantize(w)
    ref_q, ref_scale = _ct_int8(w.float())
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale) and scale.dtype == torch.float32


def test_nan_and_non_2d_weights_are_refused_by_name() -> None:
    fmt = QuantFormat(kind=INT8_CHANNEL, scale_suffix="weight_scale")
    w = torch.zeros(4, 4)
    w[1, 2] = float("nan")
    with pytest.raises(CastError, match=r"model.layers.0.mlp.up_proj.weight holds NaN"):
        fmt.quantize(w, hf_name="model.layers.0.mlp.up_proj.weight")
    w[1, 2] = float("-inf")
    with pytest.raises(CastError, match=r"o_proj.weight holds NaN or infinity"):
        fp8 = QuantFormat(kind=FP8_BLOCK, scale_suffix="weight_scale_inv", block=(128, 128))
        fp8.quantize(w, hf_name="o_proj.weight")
    with pytest.raises(CastError, match=r"norm.weight: a quantized weight is 2-D"):
        fmt.quantize(torch.ones(4), hf_name="norm.weight")


def test_formats_from_quantization_config() -> None:
    w8a8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                      "strategy": "channel", "dynamic": False},
                                          "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                                "strategy": "token", "dynamic": True}}}}
    fmt = format_from_config(w8a8)
    assert fmt is not None and fmt.kind == INT8_CHANNEL and fmt.scale_name("a.q_proj.weight") == "a.q_proj.weight_scale"
    assert fmt.ignores("lm_head") and not fmt.ignores("model.layers.0.self_attn.q_proj")
    fp8 = format_from_config({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                              "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]})
    assert fp8 is not None and fp8.kind == FP8_BLOCK and fp8.scale_name("x.weight") == "x.weight_scale_inv"
    assert fp8.scale_shape((300, 129)) == (3, 2)
    assert QuantFormat.from_dict(fp8.to_dict()) == fp8
    assert format_from_config(None) is None
    with pytest.raises(CastError, match="quant_method 'awq'"):
        format_from_config({"quant_method": "awq"})
    group = w8a8["config_groups"]["group_0"]  # type: ignore[index]
    w4 = {**w8a8, "config_groups": {"g": {**group, "weights": {**group["weights"], "num_bits": 4}}}}
    with pytest.raises(CastError, match="int8 symmetric per channel"):
        format_from_config(w4)
