"""`weightsync serve` started on a quantized checkpoint, as tests/support/quantized_models.py writes
them (compressed-tensors W8A8 int8 served in float32; "fp8" 128x128 blocks served in bfloat16): it
serves the checkpoint dequantized, declares its quantization, and an fp32 trainer pushing through the
public API sends int8 or fp8 weights with their float32 scales, dequantized at commit.

The oracle is compressed-tensors' own quantize and dequantize of the trainer's weights, cast to the
served dtype; served weights are compared by their digests (bit for bit). Faults are injected in the
trainer's quantized stream (`QuantizedSource`, patched in this process only).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file

import weightsync as ws
from quantized_models import FP8_BLOCK_CONFIG, W8A8_CONFIG, is_quantized_linear, write_quantized
from weightsync.formats.quantized import QuantFormat, format_from_config
from weightsync.integrity import digest
from weightsync.manifest import TensorMeta
from weightsync.push.quantize import QuantizedSource

# fixtures tiny_model, model_root, kit, one_torch_thread: tests/support/server_fixtures.py

FORMATS: dict[str, tuple[dict[str, Any], torch.dtype]] = {
    "int8": (W8A8_CONFIG, torch.float32), "fp8": (FP8_BLOCK_CONFIG, torch.bfloat16)}
"""Format -> (its quantization_config, the dtype the checkpoint's config serves)."""
TARGET = "model.layers.1.self_attn.k_proj.weight"
"""The weight faults are injected into ([64, 128]: a partial fp8 block)."""
INT8_ARGS = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
FP8_ARGS = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128])


@dataclass(frozen=True)
class Served:
    """One quantized `weightsync serve` of the module."""

    url: str
    fmt: QuantFormat
    dtype: torch.dtype
    client: Any

    def scale(self, hf_name: str) -> str:
        return self.fmt.scale_name(hf_name)

    def sync(self, **options: Any) -> ws.WeightSync:
        return ws.WeightSync(engines=[ws.SGLangEngine(self.url)], **{"transport": "http", "mode": "full", **options})


def _checkpoint(float_dir: Path, out_dir: Path, config: dict[str, Any], dtype: torch.dtype) -> Path:
    """The tiny float checkpoint quantized as `config` declares, the rest held (and served) in `dtype`."""
    fmt = format_from_config(config)
    assert fmt is not None
    state = {n: t if is_quantized_linear(n, fmt) else t.to(dtype) for n, t in load_file(float_dir /
                                                                                      "model.safetensors").items()}
    write_quantized(float_dir, out_dir, config, state)
    cfg = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**cfg, "dtype": str(dtype).removeprefix("torch.")}))
    return out_dir


@pytest.fixture(scope="module", params=sorted(FORMATS))
def served(request: pytest.FixtureRequest, tiny_model: Path, model_root: Path, kit: SimpleNamespace,
           one_torch_thread: None) -> Iterator[Served]:
    config, dtype = FORMATS[request.param]
    directory = _checkpoint(tiny_model, model_root / f"quantized-{request.param}", config, dtype)
    fmt = format_from_config(config)
    assert fmt is not None
    for server in kit.start_server(directory):
        client = kit.Client(server.url)
        try:
            yield Served(url=server.url, fmt=fmt, dtype=dtype, client=client)
        finally:
            client.close()


def _ct_quantize(w: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' quantization of float32 `w` [N, K]: (quantized, scale, zero point)."""
    if fmt.block is None:
        scale, zp = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), INT8_ARGS)
        return ct_quantize(w, scale, zp, INT8_ARGS, dtype=torch.int8), scale, zp
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, (-cols) % 128, 0, (-rows) % 128))
    blocks = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    scale, zp = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), FP8_ARGS)
    return ct_quantize(w, scale, zp, FP8_ARGS, dtype=torch.float8_e4m3fn), scale, zp


def _oracle(weights: dict[str, torch.Tensor], served: Served,
            scaled: Callable[[str, torch.Tensor], torch.Tensor] = lambda _, s: s) -> dict[str, torch.Tensor]:
    """hf_name -> what the server must serve for the fp32 trainer `weights`:
    compressed-tensors' dequantize(quantize(w)) in float32 (`scaled`: the scale as a fault sent it),
    cast to the served dtype; other weights cast to it."""
    out = {}
    for name, w in weights.items():
        value = w.to(served.dtype)
        if is_quantized_linear(name, served.fmt):
            q, scale, zp = _ct_quantize(w.to(torch.float32), served.fmt)
            args = INT8_ARGS if served.fmt.block is None else FP8_ARGS
            value = ct_dequantize(q, scaled(name, scale), zp, args, dtype=torch.float32).to(served.dtype)
        out[name] = value.contiguous()
    return out


def _assert_serves(served: Served, weights: dict[str, torch.Tensor], **oracle: Any) -> None:
    got, want = served.client.digests(), {n: digest(t) for n, t in _oracle(weights, served, **oracle).items()}
    assert got.keys() == want.keys()
    assert [n for n in want if got[n] != want[n]] == []


def _weights(kit: SimpleNamespace, tiny_model: Path, seed: int | None) -> dict[str, torch.Tensor]:
    """The trainer's fp32 weights: the tiny model's (what the checkpoints were quantized from), or perturbed."""
    if seed is not None:
        return kit.perturbed(tiny_model, seed=seed)
    return {n: p.detach().clone() for n, p in kit.load_model(tiny_model).named_parameters()}


def test_serves_the_checkpoint_dequantized_and_declares_it(served: Served, kit: SimpleNamespace,
                                                           tiny_model: Path) -> None:
    caps = ws.EngineCapabilities.from_dict(served.client.info()["capabilities"])
    assert caps.quantization is not None and caps.quantization.format == served.fmt
    assert len(caps.quantization.scales) == 14  # 7 linears x 2 layers; lm_head stays float
    assert caps.quantization.scales[TARGET] == served.scale(TARGET)
    assert caps.dtype == served.dtype and not caps.supports_sparse and not caps.streams_commit
    assert (TARGET, served.scale(TARGET)) in caps.fused_groups
    _assert_serves(served, _weights(kit, tiny_model, None))  # the checkpoint was quantized from these


def test_pushes_in_a_row_serve_the_trainers_weights_dequantized(served: Served, kit: SimpleNamespace,
                                                                tiny_model: Path) -> None:
    with served.sync(transport="shm") as sync:
        for seed in (11, 12, 11):
            weights = _weights(kit, tiny_model, seed)
            version = served.client.version() + 1
            report = sync.push(kit.load_model(tiny_model, weights), version=version)
            assert report.verified and report.mode == "full" and report.num_tensors == len(weights) + 14
            _assert_serves(served, weights)
    out = served.client.generate([5, 17, 42], return_logprob=True, sampling_params={"ignore_eos": True})
    assert len(out["output_ids"]) == 8
    assert all(torch.isfinite(torch.tensor(lp[0])) for lp in out["meta_info"]["output_token_logprobs"])


def test_the_logprob_probe_compares_with_the_weights_as_sent(served: Served, kit: SimpleNamespace,
                                                             tiny_model: Path) -> None:
    """`ws.probe_logprobs` against a quantized engine scores the engine's tokens with the trainer's
    weights as sent (quantized and dequantized) and reports the gap to the trainer's own weights
    beside it; the trainer's model is not changed. int8 is served in float32 here, so the engine
    computes what the as-sent weights compute, up to float32 kernels; quantizing costs more."""
    weights = _weights(kit, tiny_model, 13)
    trainer = kit.load_model(tiny_model, weights)
    with served.sync(transport="shm") as sync:
        assert sync.push(trainer, version=served.client.version() + 1).verified
    result = ws.probe_logprobs(trainer, ws.SGLangEngine(served.url), [[5, 17, 42, 7], [300, 2, 99]],
                               max_new_tokens=8)
    assert result.quantized == served.fmt.kind and result.num_tokens == 16, result
    assert result.trainer_max_gap is not None and result.trainer_mean_gap is not None, result
    assert all(torch.isfinite(torch.tensor([result.max_gap, result.trainer_max_gap]))), result
    if served.dtype == torch.float32:
        assert result.max_gap < 1e-4 < result.trainer_max_gap, result
    assert all(torch.equal(p, weights[n]) for n, p in trainer.named_parameters())
    print(f"\n{served.fmt.kind} served in {served.dtype}: gap to the weights as sent {result.max_gap:.2e}, "
          f"to the trainer's own {result.trainer_max_gap:.2e}")


def test_delta_sends_a_weight_with_its_scale_and_sparse_goes_whole(served: Served, kit: SimpleNamespace,
                                                                   tiny_model: Path) -> None:
    weights = _weights(kit, tiny_model, 21)
    with served.sync(mode="delta") as sync:
        assert sync.push(kit.load_model(tiny_model, weights), version=served.client.version() + 1).mode == "full"
        weights[TARGET] = weights[TARGET] * 1.5
        report = sync.push(kit.load_model(tiny_model, weights), version=served.client.version() + 1)
    assert report.verified and report.mode == "delta" and report.num_tensors == 2  # the weight and its scale
    _assert_serves(served, weights)
    with served.sync(mode="sparse") as sync:
        for seed in (22, 23):  # the second would go sparse into an engine that applies sparse updates
            weights = _weights(kit, tiny_model, seed)
            report = sync.push(kit.load_model(tiny_model, weights), version=served.client.version() + 1)
            assert report.verified and report.mode == "full"
            _assert_serves(served, weights)
    with pytest.raises(ws.EngineError, match=r"streams_commit"), served.sync(commit="streamed") as sync:
        sync.push(kit.load_model(tiny_model, weights), version=served.client.version() + 1)


def _fault(monkeypatch: pytest.MonkeyPatch, hf_name: str, *, meta: Callable[[TensorMeta], TensorMeta] | None = None,
           tensor: Callable[[torch.Tensor], torch.Tensor] | None = None, drop: bool = False) -> None:
    """The trainer's quantized stream with `hf_name` (a weight or a scale) changed as it declares and
    sends it (`meta`, `tensor`), or left out (`drop`)."""
    metas0, tensors0 = QuantizedSource.metas, QuantizedSource.tensors

    def metas(self: QuantizedSource) -> list[TensorMeta]:
        return [meta(m) if m.hf_name == hf_name and meta else m for m in metas0(self)
                if not (drop and m.hf_name == hf_name)]

    def tensors(self: QuantizedSource, hf_names: Any = None) -> Iterator[tuple[str, Any]]:
        names = list(hf_names) if hf_names is not None else [m.hf_name for m in metas(self)]
        for name, t in tensors0(self, names + ([hf_name] if drop and hf_name not in names else [])):
            if name != hf_name:
                yield name, t
            elif not drop:
                yield name, tensor(t) if tensor else t

    monkeypatch.setattr(QuantizedSource, "metas", metas)
    monkeypatch.setattr(QuantizedSource, "tensors", tensors)


def test_a_doubled_scale_and_a_zero_block_are_served_exactly(served: Served, kit: SimpleNamespace,
                                                             tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = _weights(kit, tiny_model, 31)
    zeroed = "model.layers.0.mlp.gate_proj.weight"  # [256, 128]: its first row, its first 128x128 block
    weights[zeroed][:128] = 0.0
    _fault(monkeypatch, served.scale(TARGET), tensor=lambda s: s * 2)
    with served.sync() as sync:
        report = sync.push(kit.load_model(tiny_model, weights), version=served.client.version() + 1)
    assert report.verified
    _assert_serves(served, weights, scaled=lambda name, s: s * 2 if name == TARGET else s)
    want = _oracle({zeroed: weights[zeroed]}, served)[zeroed]  # served bit for bit, as asserted above
    assert not want[:128].any() and want[128:].any(dim=1).all() and torch.isfinite(want).all()


def _refused(served: Served, kit: SimpleNamespace, tiny_model: Path, match: str,
             error: type[BaseException] = ws.WeightSyncError) -> Any:
    """A push the server refuses (`match`): it keeps serving its version bit for bit; returns the error."""
    before, version = served.client.digests(), served.client.version()
    with pytest.raises(error, match=match) as refused, served.sync() as sync:
        sync.push(kit.load_model(tiny_model, _weights(kit, tiny_model, 41)), version=version + 1)
    assert served.client.version() == version and served.client.digests() == before
    assert not served.client.info()["dirty"]
    return refused.value


def test_scales_missing_transposed_or_bfloat16_are_refused_at_begin_by_name(
        served: Served, kit: SimpleNamespace, tiny_model: Path) -> None:
    scale, down = served.scale(TARGET), "model.layers.1.mlp.down_proj.weight"  # [128, 256]: scales not square
    with pytest.MonkeyPatch.context() as mp:
        _fault(mp, scale, drop=True)
        _refused(served, kit, tiny_model, re.escape(f"'{TARGET}' sent without its scale"), ws.ManifestMismatchError)
    shape = served.fmt.scale_shape((128, 256))
    with pytest.MonkeyPatch.context() as mp:
        _fault(mp, served.scale(down), meta=lambda m: TensorMeta(hf_name=m.hf_name, dtype=m.dtype, shape=m.shape[::-1]),
               tensor=lambda s: s.T.contiguous())
        wrong = f"{served.scale(down)} (float32 {list(shape[::-1])}, the checkpoint holds float32 {list(shape)})"
        _refused(served, kit, tiny_model, re.escape(wrong), ws.ManifestMismatchError)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(QuantFormat, "scale_dtype", torch.bfloat16)
        q_scale = served.scale("model.layers.0.self_attn.q_proj.weight")
        shape = list(served.fmt.scale_shape((128, 128)))
        error = _refused(served, kit, tiny_model, re.escape(f"{q_scale} (bfloat16 {shape}, the checkpoint holds "
                                                            f"float32 {shape})"), ws.ManifestMismatchError)
        assert len(error.mismatched) == 14 and scale in error.mismatched


def test_a_nan_is_refused_before_the_commit_serves_it(served: Served, kit: SimpleNamespace, tiny_model: Path) -> None:
    def nan_scale(s: torch.Tensor) -> torch.Tensor:
        s = s.clone()
        s[0, 0] = float("nan")
        return s

    with pytest.MonkeyPatch.context() as mp:
        _fault(mp, served.scale(TARGET), tensor=nan_scale)
        _refused(served, kit, tiny_model, re.escape(f"'{TARGET}' dequantize to NaN or infinity"))
    if served.fmt.block is not None:  # float8 has a NaN of its own (0x7f)
        def nan_value(q: torch.Tensor) -> torch.Tensor:
            q = q.clone()
            q.view(torch.uint8)[3, 5] = 0x7F
            return q

        with pytest.MonkeyPatch.context() as mp:
            _fault(mp, TARGET, tensor=nan_value)
            _refused(served, kit, tiny_model, re.escape(f"'{TARGET}' dequantize to NaN or infinity"))
    weights = _weights(kit, tiny_model, 42)
    with served.sync() as sync:  # and the next push lands
        assert sync.push(kit.load_model(tiny_model, weights), version=served.client.version() + 1).verified
    _assert_serves(served, weights)
