"""The quantized suite at a tiny size: bf16, int8 per channel and fp8 blocks pushed into the
stand-in engine, verified, each row's bytes on the wire exactly what its format holds, and what
the stand-in served equal to the quantizer's own bytes. Timings are reported, never asserted."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import weightsync as ws
from weightsync.engines.base import EngineCapabilities
from weightsync.modes import make_mode
from weightsync_tools.bench.quantized import (
    FORMATS,
    LINEARS,
    StandInEngine,
    checkpoint_metas,
    format_table,
    quant_format,
    quantization_of,
    run_quantized_suite,
    write_quantized,
)
from weightsync_tools.bench.scenarios import make_scenario, trainer_model

MODEL_BYTES = 2 << 20  # one layer of hidden 128 (the rest is embeddings): k/v [64, 128], off the 128 block


def _expected_bytes(kind: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(weight bytes, scale bytes) of one linear weight [N, K] in format `kind` (issue 52's figures)."""
    n, k = shape
    if kind == "bf16":
        return 2 * n * k, 0
    if kind == "int8-channel":
        return n * k, 4 * n
    return n * k, 4 * math.ceil(n / 128) * math.ceil(k / 128)


def test_each_row_carries_exactly_its_formats_bytes_and_is_verified() -> None:
    result = run_quantized_suite(model_bytes=MODEL_BYTES, bucket_bytes=1 << 20, repeats=1, describe=False)
    scenario = make_scenario("dense", MODEL_BYTES)
    metas = list(make_mode("full").source(trainer_model(scenario)).metas())
    linears = [m for m in metas if m.hf_name.removesuffix(".weight").rsplit(".", 1)[-1] in LINEARS]
    assert len(linears) == 7 * scenario.model.num_layers
    assert any(m.shape[0] % 128 or m.shape[1] % 128 for m in linears), "an edge block must be covered"
    rest = sum(2 * m.numel for m in metas if m not in linears)  # bf16 in every row
    assert [r.format for r in result.rows] == list(FORMATS)
    for row in result.rows:
        weights = sum(_expected_bytes(row.format, m.shape)[0] for m in linears)
        scales = sum(_expected_bytes(row.format, m.shape)[1] for m in linears)
        assert (row.weight_bytes, row.scale_bytes, row.other_bytes) == (weights, scales, rest), row.format
        assert row.wire_bytes == weights + scales + rest, row.format
        assert row.input_bytes == 4 * sum(m.numel for m in metas) == scenario.num_bytes
        assert row.num_tensors == len(metas) + (len(linears) if row.format != "bf16" else 0)
        assert row.verified and len(row.push_runs) == 1 and len(row.convert_runs) == 1
    table = format_table(result)
    assert "stand-in" in table and all(f in table for f in FORMATS)
    document = json.loads(json.dumps(result.to_dict()))
    assert [r["wire_bytes"] for r in document["rows"]] == [r.wire_bytes for r in result.rows]


@pytest.mark.parametrize("kind", ["int8-channel", "fp8-block"])
def test_the_stand_in_serves_the_quantizers_bytes_and_refuses_an_unquantized_push(kind: str) -> None:
    model = trainer_model(make_scenario("dense", 1 << 20))
    metas = list(make_mode("full").source(model).metas())
    fmt = quant_format(kind)
    assert fmt is not None
    quantization = quantization_of(metas, fmt)
    engine = StandInEngine(checkpoint_metas(metas, quantization), quantization)
    name = next(n for n in quantization.scales if n.endswith("down_proj.weight"))
    try:
        with ws.WeightSync([engine], transport="shm", bucket_bytes=1 << 20) as sync:
            assert sync.push(model, version=1).verified
        q, scale = fmt.quantize(model.get_parameter(name).detach(), hf_name=name)
        served, served_scale = engine.weights[name], engine.weights[quantization.scales[name]]
        assert served.dtype == fmt.weight_dtype and torch.equal(served.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(served_scale, scale)
        assert engine.weights["model.norm.weight"].dtype == torch.bfloat16
    finally:
        engine.close()
    silent = _Undeclared(checkpoint_metas(metas, quantization), quantization)
    try:  # a trainer not told of the quantization sends bf16: the stand-in's begin refuses it by name
        with ws.WeightSync([silent], transport="shm", bucket_bytes=1 << 20) as sync, \
                pytest.raises(ws.WeightSyncError, match=name.replace(".", r"\.")):
            sync.push(model, version=1)
        assert silent.version == 0 and not silent.weights
    finally:
        silent.close()


class _Undeclared(StandInEngine):
    """Failure injection: a quantized stand-in that does not declare its quantization."""

    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        return replace(super().capabilities(timeout_s), quantization=None)


def test_the_w8a8_checkpoint_for_vllm_declares_what_the_stand_in_declares(tmp_path: Path) -> None:
    from weightsync.engines.quantized_checkpoint import read_quantization
    from weightsync.tiny import make_tiny_model

    scenario = make_scenario("dense", 1 << 20)
    model = trainer_model(scenario)
    float_dir = make_tiny_model(tmp_path / "bf16", replace(scenario.model, dtype="bfloat16"))
    out = write_quantized(model, float_dir, tmp_path / "w8a8", "int8-channel")
    fmt = quant_format("int8-channel")
    assert fmt is not None
    declared = read_quantization(out)
    assert declared == quantization_of(list(make_mode("full").source(model).metas()), fmt)
    name = next(iter(declared.scales))
    held = load_file(out / "model.safetensors")
    q, scale = fmt.quantize(model.get_parameter(name).detach(), hf_name=name)
    assert torch.equal(held[name], q) and torch.equal(held[declared.scales[name]], scale)
    assert held["model.norm.weight"].dtype == torch.bfloat16 and (out / "tokenizer.json").is_file()
