"""A trainer holding its Mixture-of-Experts experts one by one into a real `weightsync serve`,
which loads them fused (`expert_layout == "fused"`: transformers 5's `mlp.experts.gate_up_proj`
`[E, 2I, H]` and `down_proj` `[E, H, I]`).

The per-expert trainer is the transformers 4 layout (`mlp.experts` an `nn.ModuleList` of
gate/up/down MLPs, `moe_models.per_expert_trainer`) holding the same weights as a fused
transformers 5 model, or a plain stream of the checkpoint's per-expert tensors. Shown: its
pushes (full over shm and http, delta) are verified and served bit for bit as the fused
trainer's parameters (digests), with transformers' exact greedy tokens (float32); into a
bfloat16 serve, the served experts are the fused parameters `.to(bfloat16)` exactly; a
missing expert, a gate without its expert, and another expert count are refused before any
byte moves, naming the tensors, the engine keeping its version; a delta after an edit to
two experts sends only their layer's two fused tensors; mode="sparse" is refused, naming
the fix; mode="lora-merged" (PEFT LoRA on attention) serves PEFT's `merge_and_unload()`,
its experts stacked by torch.stack / torch.cat in the test, bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import vllm_fixtures as vf
import weightsync as ws
from moe_models import (
    CheckpointTensors,
    edit_two_experts,
    engine_and_trainer,
    fused_state,
    moe_serve,
    next_version,
    per_expert_trainer,
)
from weightsync.errors import NamingError
from weightsync.integrity import digest
from weightsync.server.launch import ServerProcess
from weightsync.sources import stacked_source
from weightsync.tiny import TinyModelConfig, build_model

FUSED_OF_LAYER_1 = {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerProcess]]:
    with moe_serve(tmp_path_factory.mktemp("moe-stacked"), "qwen3_moe") as served:
        yield served


def fused_digests(fused: torch.nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, str]:
    return {n: digest(p.detach().to(dtype).contiguous()) for n, p in fused.named_parameters()}


def test_per_expert_trainer_is_served_as_the_fused_one(served: tuple[Path, ServerProcess]) -> None:
    model_dir, server = served
    engine = ws.SGLangEngine(server.url)
    assert engine.capabilities(30.0).expert_layout == "fused"
    fused = vf.load_trainer(model_dir)
    for transport, seed in (("shm", 11), ("http", 12)):
        vf.perturb(fused, seed=seed)
        trainer = per_expert_trainer(fused)
        assert not any(p.dim() == 3 for p in trainer.parameters())
        with ws.WeightSync([engine], transport=transport) as sync:
            report = sync.push(trainer, version=(version := next_version(engine)))
        assert report.verified and report.num_tensors == 25, report
        assert report.acks[0].loaded_names >= FUSED_OF_LAYER_1
        assert engine.weight_version() == str(version)
        assert engine.digests() == fused_digests(fused), transport
        vf.assert_parity(engine, fused)
    # a plain stream of the checkpoint's per-expert tensors, stacked by the model's conversion mapping
    vf.perturb(fused, seed=13)
    stream = CheckpointTensors(ws.named_weights(fused, expert_layout="per-expert"))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in stream.held
    with ws.WeightSync([engine], transport="http") as sync:
        report = sync.push(stacked_source(stream, conversions_of=fused), version=(version := next_version(engine)))
    assert report.verified and engine.weight_version() == str(version)
    assert engine.digests() == fused_digests(fused)
    vf.assert_parity(engine, fused)


def test_incomplete_experts_and_another_count_are_refused_before_a_byte_moves(
        served: tuple[Path, ServerProcess]) -> None:
    engine, fused = engine_and_trainer(*served, seed=21)
    with ws.WeightSync([engine], transport="http") as sync:
        sync.push(per_expert_trainer(fused), version=(version := next_version(engine)))
        before = engine.digests()
        # expert 3 of layer 1 lost (an empty module in its place): the fused tensors of its layer are incomplete
        lost = per_expert_trainer(fused)
        lost.model.layers[1].mlp.experts[3] = torch.nn.Module()
        with pytest.raises(NamingError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj lacks .*"
                           r"model\.layers\.1\.mlp\.experts\.3\.gate_proj\.weight") as refused:
            sync.push(lost, version=version + 1)
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in str(refused.value)
        assert "expert_layout='per-expert'" in str(refused.value)
        # a gate without its up, in a stream of checkpoint tensors
        stream = CheckpointTensors((n, t) for n, t in ws.named_weights(fused, expert_layout="per-expert")
                                   if n != "model.layers.0.mlp.experts.5.up_proj.weight")
        with pytest.raises(NamingError,
                           match=r"gate_up_proj lacks 'model\.layers\.0\.mlp\.experts\.5\.up_proj\.weight';"):
            stacked_source(stream, conversions_of=fused)
        # six experts where the engine holds eight: the fused tensors' shapes differ, named by the engine
        six = per_expert_trainer(build_model(TinyModelConfig(arch="qwen3_moe", num_experts=6)))
        with pytest.raises(ws.ManifestMismatchError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj") \
                as mismatch:
            sync.push(six, version=version + 1)
        assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"} \
            <= set(mismatch.value.mismatched)
    assert engine.weight_version() == str(version)
    assert engine.digests() == before


def test_delta_after_two_experts_sends_their_layer_and_sparse_is_refused(
        served: tuple[Path, ServerProcess]) -> None:
    engine, fused = engine_and_trainer(*served, seed=31)
    with ws.WeightSync([engine], transport="http", mode="delta") as sync:
        sync.push(per_expert_trainer(fused), version=next_version(engine))  # the base delta remembers
        edit_two_experts(fused, layer=1)  # the same edit, made on the fused copy: the expected weights
        trainer = per_expert_trainer(fused)
        report = sync.push(trainer, version=(version := next_version(engine)))
    assert report.verified and report.mode == "delta", report
    assert report.acks[0].loaded_names == FUSED_OF_LAYER_1, report.acks[0]
    assert engine.weight_version() == str(version)
    assert engine.digests() == fused_digests(fused)
    vf.assert_parity(engine, fused)
    with ws.WeightSync([engine], transport="http", mode="sparse") as sync, pytest.raises(
            ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj is stacked .*mode='delta'"):
        sync.push(trainer, version=version + 1)
    assert engine.weight_version() == str(version)


def test_lora_merged_serves_peft_merge_stacked(served: tuple[Path, ServerProcess]) -> None:
    from peft import LoraConfig, get_peft_model

    engine, fused = engine_and_trainer(*served, seed=51)
    # on attention: PEFT 0.21 turns expert targets of a qwen3_moe model into target_parameters on the fused
    # gate_up_proj / down_proj (the transformers 5 layout), which a per-expert trainer does not have
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    peft_model = get_peft_model(per_expert_trainer(fused), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    vf.set_adapter_weights(peft_model, seed=6)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    merged = fused_state(copy.deepcopy(peft_model).merge_and_unload())
    with ws.WeightSync([engine], transport="http", mode="lora-merged") as sync:
        report = sync.push(peft_model, version=(version := next_version(engine)))
    assert report.verified and report.mode == "lora-merged" and report.num_tensors == 25, report
    assert engine.weight_version() == str(version)
    assert engine.digests() == {n: digest(t) for n, t in merged.items()}, "PEFT's merge, stacked, bit for bit"
    changed = {n for n, p in fused.named_parameters() if not torch.equal(merged[n], p)}
    assert changed == {f"model.layers.{i}.self_attn.{m}.weight" for i in (0, 1) for m in targets}
    assert all(torch.equal(p, before[n]) for n, p in peft_model.named_parameters()), "trainer left bit-identical"
    fused.load_state_dict(merged)
    vf.assert_parity(engine, fused)


def test_fp32_per_expert_trainer_into_bf16_serve_is_the_cast_fused_params(tmp_path: Path) -> None:
    with moe_serve(tmp_path, "qwen3_moe", dtype="bfloat16") as (model_dir, server):
        engine, fused = engine_and_trainer(model_dir, server, seed=41)  # fp32 master weights
        with ws.WeightSync([engine], transport="shm") as sync:
            report = sync.push(per_expert_trainer(fused), version=(version := next_version(engine)))
        assert report.verified and any("cast from float32 to bfloat16" in n for n in report.notes), report
        assert engine.weight_version() == str(version)
        assert engine.digests() == fused_digests(fused, torch.bfloat16)
