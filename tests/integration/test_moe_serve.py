"""Mixture-of-Experts trainers (transformers 5, fused experts) into a real `weightsync serve`.

`weightsync serve` holds transformers' own model, so it declares the fused expert layout
(`EngineCapabilities.expert_layout == "fused"`) and takes `mlp.experts.gate_up_proj`
`[E, 2I, H]` and `down_proj` as the trainer holds them (no copy, no split). Shown:
float32 pushes (full, delta, sparse) served with transformers' exact greedy tokens; a
delta after a change to two experts sends only the fused tensors of their layer; the
router's `e_score_correction_bias` (a persistent buffer, GLM-4.5 / DeepSeek-V3 style)
travels and is acked; a trainer without it, and one with another expert count, are
refused before any byte moves, naming the tensor, and the engine keeps its version;
a bfloat16 engine serves `trainer_tensor.to(bfloat16)` bit for bit and scores its own
tokens as transformers does on those weights (the machine-independent criterion of
tests/contract/test_sparse.py). mode="lora-merged" with PEFT LoRA on the attention layers
serves PEFT's `merge_and_unload()` bit for bit and leaves the trainer untouched, and so
does LoRA on the fused experts themselves (PEFT's `target_parameters`, one ParamWrapper per
parameter) over shm.
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
    MIXTRAL_PROJECTIONS,
    CheckpointTensors,
    as_the_engine_holds,
    edit_two_experts,
    engine_and_trainer,
    moe_serve,
    next_version,
    per_expert_trainer,
)
from weightsync.integrity import digest
from weightsync.server.launch import ServerProcess
from weightsync.sources import stacked_source
from weightsync.tiny import TinyModelConfig, build_model

BF16_MAX_GAP = 0.05
BF16_MEAN_GAP = 0.01
"""The bounds of tests/contract/test_sparse.py (bf16 kernels vs transformers' bf16 eager).
Measured here for the bf16 MoE serve: max 0.0077, mean 0.0009 (2-core Intel Xeon), a
margin of 6.5x and 11x; the served bytes themselves are checked exactly (digests), so a
stale or skipped tensor fails on those, not on this bound."""


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerProcess]]:
    with moe_serve(tmp_path_factory.mktemp("moe-serve"), "qwen3_moe") as served:
        yield served


def test_serve_takes_fused_experts_full_delta_sparse(qwen3_moe: tuple[Path, ServerProcess]) -> None:
    model_dir, server = qwen3_moe
    engine = ws.SGLangEngine(server.url)
    assert engine.capabilities(30.0).expert_layout == "fused"
    trainer = vf.load_trainer(model_dir)
    fused = [n for n, p in trainer.named_parameters() if p.dim() == 3]
    assert len(fused) == 4
    vf.perturb(trainer, seed=1)
    with ws.WeightSync([engine], transport="shm") as sync:
        report = sync.push(trainer, version=(version := next_version(engine)))
        assert report.verified and report.num_tensors == 25
        assert set(fused) <= report.acks[0].loaded_names
        vf.assert_parity(engine, trainer)
    for mode in ("delta", "sparse"):
        with ws.WeightSync([engine], transport="http", mode=mode) as sync:
            sync.push(trainer, version=(version := next_version(engine)))  # the base this mode remembers
            edit_two_experts(trainer, layer=1)
            report = sync.push(trainer, version=(version := next_version(engine)))
            assert report.verified and report.mode == mode
            # fused layout: the two experts live in their layer's two fused tensors, and only those are sent
            assert report.acks[0].loaded_names == {"model.layers.1.mlp.experts.gate_up_proj",
                                                   "model.layers.1.mlp.experts.down_proj"}, report.acks[0]
            assert engine.weight_version() == str(version)
            vf.assert_parity(engine, trainer)


def test_serve_takes_streamed_pushes_of_fused_experts(qwen3_moe: tuple[Path, ServerProcess]) -> None:
    model_dir, server = qwen3_moe
    engine = ws.SGLangEngine(server.url)
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=11)
    with ws.WeightSync([engine], transport="http", mode="sparse", commit="streamed", bucket_bytes=64 << 10) as sync:
        report = sync.push(trainer, version=(version := next_version(engine)))  # whole: no base yet
        assert report.verified and report.commit == "streamed" and report.num_buckets > 2
        edit_two_experts(trainer, layer=1)
        report = sync.push(trainer, version=(version := next_version(engine)))
        assert report.verified and report.mode == "sparse" and report.commit == "streamed"
    assert engine.weight_version() == str(version)
    assert engine.digests() == {n: digest(t) for n, t in trainer.state_dict().items()}
    vf.assert_parity(engine, trainer)


def test_lora_merged_on_attention_serves_the_merged_weights(qwen3_moe: tuple[Path, ServerProcess]) -> None:
    from peft import LoraConfig, get_peft_model

    model_dir, server = qwen3_moe
    engine = ws.SGLangEngine(server.url)
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    peft_model = get_peft_model(vf.load_trainer(model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=attention))
    vf.set_adapter_weights(peft_model, seed=5)
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    merged = copy.deepcopy(peft_model).merge_and_unload()
    with ws.WeightSync([engine], transport="http", mode="lora-merged") as sync:
        report = sync.push(peft_model, version=(version := next_version(engine)))
    assert report.verified and report.mode == "lora-merged" and report.num_tensors == 25
    served = engine.digests()
    assert served == {n: digest(t) for n, t in merged.state_dict().items()}, "PEFT's merge, bit for bit"
    base = vf.load_trainer(model_dir).state_dict()
    changed = {n for n, t in merged.state_dict().items() if not torch.equal(t, base[n])}
    assert changed == {f"model.layers.{i}.self_attn.{m}.weight" for i in (0, 1) for m in attention}
    assert all(torch.equal(p, before[n]) for n, p in peft_model.named_parameters()), "trainer left bit-identical"
    vf.assert_parity(engine, merged)
    # LoRA on the fused experts too (PEFT target_parameters): merged as PEFT merges it
    on_experts = get_peft_model(vf.load_trainer(model_dir), LoraConfig(
        r=4, lora_alpha=8, target_modules=attention,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    vf.set_adapter_weights(on_experts, seed=6)
    before = {n: p.detach().clone() for n, p in on_experts.named_parameters()}
    merged = copy.deepcopy(on_experts).merge_and_unload()
    with ws.WeightSync([engine], transport="shm", mode="lora-merged") as sync:
        report = sync.push(on_experts, version=(version := next_version(engine)))
    assert report.verified and report.num_tensors == 25 and engine.weight_version() == str(version)
    assert engine.digests() == {n: digest(t) for n, t in merged.state_dict().items()}, "PEFT's merge, bit for bit"
    changed = {n for n, t in merged.state_dict().items() if not torch.equal(t, base[n])}
    assert changed == {f"model.layers.{i}.{m}" for i in (0, 1) for m in (
        *(f"self_attn.{a}.weight" for a in attention), "mlp.experts.gate_up_proj", "mlp.experts.down_proj")}
    assert all(torch.equal(p, before[n]) for n, p in on_experts.named_parameters()), "trainer left bit-identical"
    vf.assert_parity(engine, merged)


def test_router_buffer_travels_and_a_trainer_without_it_is_refused(tmp_path: Path) -> None:
    bias_name = "model.layers.1.mlp.gate.e_score_correction_bias"
    with moe_serve(tmp_path, "glm4_moe") as (model_dir, server):
        engine = ws.SGLangEngine(server.url)
        trainer = vf.load_trainer(model_dir)
        vf.perturb(trainer, seed=2)
        router = trainer.get_submodule("model.layers.1.mlp.gate")
        with torch.no_grad():
            router.e_score_correction_bias.add_(torch.linspace(-0.5, 0.5, 8))  # routing changes with it
        with ws.WeightSync([engine], transport="http") as sync:
            report = sync.push(trainer, version=(version := next_version(engine)))
            assert report.verified and bias_name in report.acks[0].loaded_names
            assert engine.digests([bias_name])[bias_name] == digest(router.e_score_correction_bias)
            vf.assert_parity(engine, trainer)
            before = vf.greedy_tokens(engine)
            # a trainer whose router keeps the bias as derived state (not persistent): nothing to send
            lacking = copy.deepcopy(trainer)
            lacking_router = lacking.get_submodule("model.layers.1.mlp.gate")
            lacking_router.register_buffer("e_score_correction_bias", lacking_router.e_score_correction_bias * 0,
                                           persistent=False)
            with pytest.raises(ws.ManifestMismatchError, match="e_score_correction_bias") as refused:
                sync.push(lacking, version=version + 1)
            assert bias_name in refused.value.missing
            # another expert count: the fused tensors' shapes differ, named
            other = build_model(TinyModelConfig(arch="glm4_moe", num_experts=6))
            with pytest.raises(ws.ManifestMismatchError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj") \
                    as refused:
                sync.push(other, version=version + 1)
            assert "model.layers.1.mlp.experts.gate_up_proj" in refused.value.mismatched
        assert engine.weight_version() == str(version)
        assert vf.greedy_tokens(engine) == before


def test_bf16_serve_serves_the_cast_experts(tmp_path: Path) -> None:
    with moe_serve(tmp_path, "qwen3_moe", dtype="bfloat16") as (model_dir, server):
        engine, trainer = engine_and_trainer(model_dir, server, seed=3)  # fp32 master weights
        with ws.WeightSync([engine], transport="shm") as sync:
            report = sync.push(trainer, version=(version := next_version(engine)))
        assert report.verified and any("cast from float32 to bfloat16" in n for n in report.notes)
        assert engine.weight_version() == str(version)
        assert engine.digests() == {n: digest(p.detach().to(torch.bfloat16).contiguous())
                                    for n, p in trainer.named_parameters()}
        result = ws.probe_logprobs(copy.deepcopy(trainer).to(torch.bfloat16), engine, vf.PROMPTS, max_new_tokens=8)
        assert result.max_gap < BF16_MAX_GAP and result.mean_gap < BF16_MEAN_GAP, result
        print(f"\nbf16 MoE serve: max gap {result.max_gap:.4f}, mean {result.mean_gap:.4f}")


def test_bf16_glm_serve_keeps_its_router_bias_in_float32_and_gets_the_masters_values(tmp_path: Path) -> None:
    """transformers keeps GLM-4.5's `e_score_correction_bias` in float32 under a bfloat16 model
    (`_keep_in_fp32_modules_strict`): the engine declares it (`kept_dtypes`), a float32 trainer
    sends it in float32 (a value no bfloat16 holds arrives exact) and everything else cast."""
    bias_name = "model.layers.1.mlp.gate.e_score_correction_bias"
    with moe_serve(tmp_path, "glm4_moe", dtype="bfloat16") as (model_dir, server):
        engine = ws.SGLangEngine(server.url)
        assert engine.capabilities(30.0).kept_dtypes == {bias_name: torch.float32}
        trainer = vf.load_trainer(model_dir).float()  # fp32 master weights
        vf.perturb(trainer, seed=4)
        bias = trainer.get_submodule("model.layers.1.mlp.gate").e_score_correction_bias
        with torch.no_grad():
            bias.add_(torch.linspace(-0.5, 0.5, 8) + 1e-3 / 3)  # routing moves; not bfloat16 values
        assert not torch.equal(bias.to(torch.bfloat16).float(), bias)
        for transport, mode in (("shm", "full"), ("http", "sparse")):
            with ws.WeightSync([engine], transport=transport, mode=mode) as sync:
                report = sync.push(trainer, version=(version := next_version(engine)))
                if mode == "sparse":  # the base this mode remembers, then only the router bias moves
                    with torch.no_grad():
                        bias.add_(1e-3 / 7)
                    report = sync.push(trainer, version=(version := next_version(engine)))
                    assert report.mode == "sparse" and report.acks[0].loaded_names == {bias_name}, report
            assert report.verified and engine.weight_version() == str(version)
            assert any(f"1 tensor(s) sent in float32, as the engines keep them: '{bias_name}'" in n
                       for n in report.notes), report.notes
            served = engine.digests()
            assert served[bias_name] == digest(bias.detach())
            assert served == {n: digest(t.detach() if n == bias_name else t.detach().to(torch.bfloat16).contiguous())
                              for n, t in trainer.state_dict().items() if n in served}
        result = ws.probe_logprobs(as_the_engine_holds(trainer, [bias_name]), engine, vf.PROMPTS, max_new_tokens=8)
        assert result.max_gap < BF16_MAX_GAP and result.mean_gap < BF16_MEAN_GAP, result
        print(f"\nbf16 GLM-4-MoE serve: max gap {result.max_gap:.4f}, mean {result.mean_gap:.4f}")


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_mixtral_and_deepseek_v3_serve_the_pushed_weights(arch: str, tmp_path: Path) -> None:
    """`weightsync serve` holds transformers' own model, so it takes the names the trainer's model
    holds (Mixtral's `mlp.`, not its checkpoint's `block_sparse_moe.`; DeepSeek-V3's MLA tensors
    and router bias): a float32 push over shm is served bit for bit (digests), with transformers'
    exact greedy tokens, which the push changed. A Mixtral trainer holding its experts one by one
    (`w1`/`w3`/`w2`) is stacked by Mixtral's own patterns into the fused tensors served."""
    with moe_serve(tmp_path, arch) as (model_dir, server):
        engine, trainer = engine_and_trainer(model_dir, server, seed=4)
        assert engine.capabilities(30.0).expert_layout == "fused"
        before = vf.greedy_tokens(engine)
        with ws.WeightSync([engine], transport="shm") as sync:
            report = sync.push(trainer, version=(version := next_version(engine)))
            assert report.verified and engine.weight_version() == str(version)
            assert engine.digests() == {n: digest(t) for n, t in trainer.state_dict().items()}
            assert "model.layers.1.mlp.experts.gate_up_proj" in report.acks[0].loaded_names
            vf.assert_parity(engine, trainer)
            assert vf.greedy_tokens(engine) != before, "the push changed nothing the engine serves"
            if arch == "mixtral":
                vf.perturb(trainer, seed=5)
                report = sync.push(per_expert_trainer(trainer, MIXTRAL_PROJECTIONS),
                                   version=(version := next_version(engine)))
                assert report.verified and engine.weight_version() == str(version)
                assert engine.digests() == {n: digest(t) for n, t in trainer.state_dict().items()}
                vf.assert_parity(engine, trainer)
                # a plain stream in Mixtral's checkpoint names (a Megatron-style export: `block_sparse_moe.`,
                # per-expert w1/w3/w2), stacked and renamed to the names the engine's model holds
                vf.perturb(trainer, seed=6)
                stream = CheckpointTensors(ws.named_weights(trainer, expert_layout="per-expert"))
                assert "model.layers.0.block_sparse_moe.gate.weight" in stream.held
                report = sync.push(stacked_source(stream, conversions_of=trainer),
                                   version=(version := next_version(engine)))
                assert report.verified and engine.weight_version() == str(version)
                assert engine.digests() == {n: digest(t) for n, t in trainer.state_dict().items()}
                vf.assert_parity(engine, trainer)
