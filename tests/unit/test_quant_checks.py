"""What cannot be right is refused before a byte moves (plain casts to float8 or int8, forced dtypes
into quantized engines, weights without scales, scales of the wrong dtype or shape), and the
trainer's stream quantized once, each scale a tensor of its own."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from torch import nn

from weightsync.bucketing import plan_buckets, unpack
from weightsync.engines.base import EngineCapabilities
from weightsync.errors import CastError, ManifestMismatchError
from weightsync.formats.quantized import (
    FP8_BLOCK,
    INT8_CHANNEL,
    QuantFormat,
    Quantization,
    check_quantized,
    expected_dtype,
    quantized_weights,
)
from weightsync.manifest import TensorMeta
from weightsync.push.packer import pack_stream, stream_order
from weightsync.push.planning import cast_dtype, served_quantization
from weightsync.push.quantize import QuantizedSource

INT8 = QuantFormat(kind=INT8_CHANNEL, scale_suffix="weight_scale", ignore=("lm_head",))
FP8 = QuantFormat(kind=FP8_BLOCK, scale_suffix="weight_scale_inv", block=(128, 128))
Q, OUT = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"


def _meta(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorMeta:
    return TensorMeta(hf_name=name, dtype=dtype, shape=shape)


CHECKPOINT = {m.hf_name: m for m in (  # the W8A8 checkpoint's own headers
    _meta(f"{Q}.weight", torch.int8, (128, 64)), _meta(f"{Q}.weight_scale", torch.float32, (128, 1)),
    _meta(f"{OUT}.weight", torch.int8, (64, 128)), _meta(f"{OUT}.weight_scale", torch.float32, (64, 1)),
    _meta("lm_head.weight", torch.float32, (512, 64)), _meta("model.norm.weight", torch.float32, (64,)),
)}


def _sent(**changes: TensorMeta | None) -> list[TensorMeta]:
    """The checkpoint's metas as a quantized push sends them, with `changes` (name with "." as "__")."""
    out = dict(CHECKPOINT)
    for key, meta in changes.items():
        name = key.replace("__", ".")
        if meta is None:
            del out[name]
        else:
            out[name] = meta
    return list(out.values())


def test_a_quantized_push_passes_the_check() -> None:
    check_quantized(_sent(), CHECKPOINT, INT8, who="vllm")
    assert quantized_weights(list(CHECKPOINT.values()), INT8) == {f"{Q}.weight": f"{Q}.weight_scale",
                                                                  f"{OUT}.weight": f"{OUT}.weight_scale"}


@pytest.mark.parametrize(("change", "named", "says"), [
    ({f"{Q}.weight": _meta(f"{Q}.weight", torch.bfloat16, (128, 64))}, f"{Q}.weight", "push with quantize"),
    ({f"{Q}.weight_scale": None}, f"{Q}.weight", "without its scale"),
    ({f"{OUT}.weight": None}, f"{OUT}.weight", "without its scale"),
    ({f"{Q}.weight_scale": _meta(f"{Q}.weight_scale", torch.bfloat16, (128, 1))}, f"{Q}.weight_scale", "bfloat16"),
    ({f"{Q}.weight_scale": _meta(f"{Q}.weight_scale", torch.float32, (1, 128))}, f"{Q}.weight_scale", r"\[1, 128\]"),
    ({f"{Q}.weight_scale": _meta(f"{Q}.weight_scale", torch.float32, (256, 1))}, f"{Q}.weight_scale", r"\[256, 1\]"),
])
def test_what_cannot_load_right_is_refused_by_name(change: dict[str, TensorMeta | None], named: str,
                                                   says: str) -> None:
    sent = _sent(**{k.replace(".", "__"): v for k, v in change.items()})
    with pytest.raises(ManifestMismatchError, match=says) as refused:
        check_quantized(sent, CHECKPOINT, INT8, who="vllm")
    assert named in str(refused.value) and named in refused.value.mismatched + refused.value.missing


def test_scales_of_fused_layers_are_expected_in_the_checkpoints_dtype() -> None:
    """The issue's finding: the expected metas asked bfloat16 for q/k/v and gate/up scales (vLLM holds
    them fused under another name, so no kept dtype matched); the checkpoint holds float32."""
    scales = quantized_weights(list(CHECKPOINT.values()), INT8)
    assert expected_dtype(f"{Q}.weight_scale", torch.float32, torch.bfloat16, {}, scales) == torch.float32
    assert expected_dtype(f"{Q}.weight", torch.int8, torch.bfloat16, {}, scales) == torch.int8
    assert expected_dtype("model.norm.weight", torch.float32, torch.bfloat16, {}, scales) == torch.bfloat16


def _caps(quantization: Quantization | None, dtype: torch.dtype = torch.bfloat16) -> EngineCapabilities:
    return EngineCapabilities(dtype=dtype, quantization=quantization)


def test_plain_casts_to_float8_or_int8_are_refused() -> None:
    with pytest.raises(CastError, match=r"dtype= float8_e4m3fn: a plain cast to it drops the scales"):
        cast_dtype(torch.float8_e4m3fn, {"a": _caps(None)}, cast=True)
    with pytest.raises(CastError, match=r"a serves float8_e4m3fn"):
        cast_dtype(None, {"a": _caps(None, torch.float8_e4m3fn)}, cast=True)


def test_quantized_engines_are_pushed_quantized_or_not_at_all() -> None:
    q = Quantization(format=INT8, scales={f"{Q}.weight": f"{Q}.weight_scale"})
    assert served_quantization({"a": _caps(q), "b": _caps(q)}, cast=True, forced=None) == q
    assert served_quantization({"a": _caps(q)}, cast=False, forced=None) is None  # lora: adapters only
    with pytest.raises(CastError, match=r"a serves int8-channel, b serves floats"):
        served_quantization({"a": _caps(q), "b": _caps(None)}, cast=True, forced=None)
    with pytest.raises(CastError, match=r"a serves quantized weights \(int8-channel\); dtype=bfloat16"):
        served_quantization({"a": _caps(q)}, cast=True, forced=torch.bfloat16)
    cast = cast_dtype(None, {"a": _caps(q)}, cast=True, quantization=q)
    assert cast.of(f"{Q}.weight", torch.int8) == torch.int8
    assert cast.of(f"{Q}.weight_scale", torch.float32) == torch.float32  # never cast to the engine's bfloat16
    assert cast.of("model.norm.weight", torch.float32) == torch.bfloat16
    assert EngineCapabilities.from_dict(_caps(q).to_dict()).quantization == q


class _StateSource:
    """A module's parameters as a `WeightSource` (what `ModuleSource` yields for a plain module)."""

    mode = "full"

    def __init__(self, model: nn.Module) -> None:
        self._state = {n: p.detach() for n, p in model.named_parameters()}

    def metas(self) -> list[TensorMeta]:
        return [_meta(n, t.dtype, tuple(t.shape)) for n, t in self._state.items()]

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in hf_names if hf_names is not None else list(self._state):
            yield name, self._state[name]


class _Tiny(nn.Module):
    def __init__(self, out_q: int, in_q: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.q_proj = nn.Linear(in_q, out_q, bias=True)
        self.o_proj = nn.Linear(out_q, in_q, bias=False)
        self.norm = nn.LayerNorm(in_q)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
            self.o_proj.weight[:128, :128] = 0.0  # an all-zero block: served exactly, scale eps, zeros


@pytest.mark.parametrize("fmt", [INT8, FP8], ids=["int8", "fp8"])
def test_the_stream_is_quantized_once_each_scale_a_tensor(fmt: QuantFormat) -> None:
    model = _Tiny(200, 136)
    scales = {"q_proj.weight": fmt.scale_name("q_proj.weight"), "o_proj.weight": fmt.scale_name("o_proj.weight")}
    source = QuantizedSource(_StateSource(model), Quantization(format=fmt, scales=scales))
    metas = {m.hf_name: m for m in source.metas()}
    assert metas["q_proj.weight"].dtype == fmt.weight_dtype and metas["q_proj.bias"].dtype == torch.float32
    assert metas[scales["q_proj.weight"]] == _meta(scales["q_proj.weight"], torch.float32,
                                                   fmt.scale_shape((200, 136)))
    plan = plan_buckets(list(metas.values()), 64 << 10)
    packed = {}
    for bucket, buffer in pack_stream(plan, source.tensors(stream_order(plan))):
        assert buffer is not None
        packed.update((name, t.clone()) for name, t in unpack(buffer, bucket))
    for weight, scale in scales.items():
        q, s = fmt.quantize(model.get_parameter(weight))
        assert torch.equal(packed[weight].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(packed[scale], s)
    assert torch.equal(packed["norm.weight"], model.norm.weight.detach())
    # the scale asked first: the weight is read once, quantized, and kept for its turn
    order = [scales["o_proj.weight"], "norm.weight", "o_proj.weight"]
    got = dict(source.tensors(order))
    assert list(got) == order and torch.equal(got["o_proj.weight"].view(torch.uint8), packed["o_proj.weight"]
                                              .view(torch.uint8))
    with pytest.raises(ValueError, match="without the tensor quantized with it"):
        list(source.tensors(["q_proj.weight"]))


def test_a_vllm_declares_what_its_checkpoint_holds_quantized() -> None:
    from types import SimpleNamespace

    from weightsync.engines.vllm.quantized import served_quantization as vllm_quantization

    config = {"quant_method": "compressed-tensors", "ignore": ["lm_head"],
              "config_groups": {"g": {"targets": ["Linear"],
                                      "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                  "block_structure": [128, 128]}}}}
    checkpoint = [_meta(f"{Q}.weight", torch.float8_e4m3fn, (256, 64)),
                  _meta(f"{Q}.weight_scale", torch.float32, (2, 1)), _meta("lm_head.weight", torch.float32, (9, 64))]
    declared = vllm_quantization(SimpleNamespace(quantization_config=config), checkpoint)
    assert declared is not None and declared.format.kind == FP8_BLOCK
    assert declared.scales == {f"{Q}.weight": f"{Q}.weight_scale"}  # lm_head: no scale in the headers
    assert vllm_quantization(SimpleNamespace(), checkpoint) is None
