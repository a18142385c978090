"""Mixture-of-Experts naming: transformers 5's fused experts as the checkpoint's per-expert
tensors (views, bit-equal to what save_pretrained writes), persistent buffers sent and
non-persistent ones not, the layout an engine declares, and vLLM's MoE reload groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weightsync.engines.base import EngineCapabilities
from weightsync.engines.vllm.reload import layer_groups
from weightsync.naming import map_names
from weightsync.sources import ModuleSource
from weightsync.tiny import TinyModelConfig, build_model


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "mixtral", "deepseek_v3"])
def test_per_expert_stream_is_save_pretrained_bit_for_bit_as_views(arch: str, tmp_path: Path) -> None:
    """Names, shapes and bytes are exactly what save_pretrained writes: for Mixtral that is its
    checkpoint's `block_sparse_moe.` block (router and experts, `w1`/`w3`/`w2`), which
    transformers renames to `mlp.` on load and back on save."""
    model = build_model(TinyModelConfig(arch=arch))
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    source = ModuleSource(model)
    assert {m.hf_name: m.shape for m in source.metas()} == {n: tuple(t.shape) for n, t in saved.items()}
    assert len(source.metas()) == {"qwen3_moe": 69, "glm4_moe": 47, "mixtral": 65, "deepseek_v3": 53}[arch]
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()} | \
        {b.untyped_storage().data_ptr() for b in model.buffers()}
    for hf_name, tensor in source.tensors():
        assert torch.equal(tensor, saved[hf_name]), hf_name
        assert tensor.is_contiguous() and tensor.untyped_storage().data_ptr() in storages, f"{hf_name}: not a view"


def test_fused_layout_is_the_model_as_held_and_buffers_follow_persistence() -> None:
    model = build_model(TinyModelConfig(arch="glm4_moe"))
    fused = {m.hf_name for m in ModuleSource(model, expert_layout="fused").metas()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in fused  # persistent: sent
    assert not any("inv_freq" in n for n in fused)  # rotary caches are not persistent: never sent
    assert fused == set(model.state_dict())
    assert map_names(model).hf_names == tuple(ModuleSource(model, expert_layout="fused")._names)


def test_mixtral_names_its_checkpoint_per_expert_and_its_model_fused() -> None:
    """The renaming is reversed for the per-expert (checkpoint) layout only: `weightsync serve`
    (fused) holds transformers' own model, whose names are `mlp.`; the same names come back
    from a model loaded with from_pretrained (its `_weight_conversions`)."""
    model = build_model(TinyModelConfig(arch="mixtral"))
    per_expert = set(map_names(model, expert_layout="per-expert").hf_names)
    assert {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.7.w3.weight",
            "model.layers.0.self_attn.q_proj.weight"} <= per_expert
    assert not any(".mlp." in n for n in per_expert)
    fused = map_names(model, expert_layout="fused").hf_names
    assert set(fused) == set(model.state_dict()) and "model.layers.1.mlp.gate.weight" in fused
    assert map_names(model).hf_names == fused


def test_a_loaded_mixtral_names_its_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    build_model(TinyModelConfig(arch="mixtral")).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(map_names(loaded, expert_layout="per-expert").hf_names) == set(saved)


def test_experts_of_a_module_without_transformers_flags_are_not_split() -> None:
    class Experts(torch.nn.Module):  # 3-D, but nothing declares a layout: sent as held
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 6, 3))

    names = map_names(torch.nn.ModuleDict({"experts": Experts()}), expert_layout="per-expert").hf_names
    assert names == ("experts.gate_up_proj",)


def test_capabilities_carry_the_expert_layout() -> None:
    caps = EngineCapabilities(expert_layout="fused")
    assert EngineCapabilities.from_dict(caps.to_dict()).expert_layout == "fused"
    assert EngineCapabilities.from_dict({}).expert_layout == "per-expert"
    with pytest.raises(ValueError, match="expert_layout"):
        EngineCapabilities.from_dict({"expert_layout": "stacked"})


def test_an_moe_layers_experts_reload_together_in_vllm() -> None:
    known = [f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(3) for p in ("gate_proj", "up_proj")]
    known += ["model.layers.1.mlp.gate.weight", "model.layers.1.self_attn.q_proj.weight",
              "model.layers.1.self_attn.k_proj.weight"]
    groups = layer_groups(known, moe_layers=["model.layers.1.mlp.experts"])
    assert sorted(map(sorted, groups)) == sorted([sorted(known[:6]), sorted(known[7:])])


def test_lora_merged_per_expert_stream_and_lora_on_experts() -> None:
    """lora-merged into a per-expert engine (vLLM): attention LoRA merged, experts as views of the
    base. LoRA on the fused experts too (PEFT target_parameters: one ParamWrapper per parameter,
    nested) is merged in either layout, each expert a view of its merged fused tensor, bit for bit
    PEFT's merge_and_unload(), the trainer left as it was; mode "lora" refuses it by name."""
    import copy

    from peft import LoraConfig, get_peft_model

    from weightsync.lora.source import LoraSource, MergedLoraSource

    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    peft_model = get_peft_model(build_model(TinyModelConfig(arch="qwen3_moe")),
                                LoraConfig(r=4, target_modules=attention, init_lora_weights=False))
    want = dict(ModuleSource(copy.deepcopy(peft_model).merge_and_unload()).tensors())
    got = dict(MergedLoraSource(peft_model).tensors())
    assert list(got) == list(want) and len(got) == 69
    assert all(torch.equal(got[n], want[n]) for n in want)
    on_experts = get_peft_model(build_model(TinyModelConfig(arch="qwen3_moe")), LoraConfig(
        r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False))
    before = {n: p.detach().clone() for n, p in on_experts.named_parameters()}
    merged = copy.deepcopy(on_experts).merge_and_unload()
    base = dict(ModuleSource(build_model(TinyModelConfig(arch="qwen3_moe")), expert_layout="fused").tensors())
    for layout, count in (("per-expert", 69), ("fused", 25)):
        want = dict(ModuleSource(merged, expert_layout=layout).tensors())
        got = dict(MergedLoraSource(on_experts, expert_layout=layout).tensors())
        assert list(got) == list(want) and len(got) == count
        assert [n for n in want if not torch.equal(got[n], want[n])] == [], layout
    changed = {n for n, t in dict(ModuleSource(merged, expert_layout="fused").tensors()).items()
               if not torch.equal(t, base[n])}
    assert changed == {f"model.layers.{i}.{m}" for i in (0, 1) for m in (
        "self_attn.q_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")}
    assert all(torch.equal(p, before[n]) for n, p in on_experts.named_parameters()), "trainer left as it was"
    with pytest.raises(ValueError, match=r"experts' \(ParamWrapper\): LoRA on the parameter 'down_proj'.*"
                                         r"is not sent as an adapter.*mode='lora-merged'"):
        LoraSource(on_experts)
