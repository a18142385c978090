"""Per-expert checkpoint names grouped into the fused tensors an engine of `expert_layout="fused"`
loads (`naming.stack_expert_names`, `expert_stacks`): by transformers' conversion mapping of the
model, complete or refused by name, and never from names alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_models import MIXTRAL_PROJECTIONS, per_expert_trainer
from weightsync.errors import NamingError
from weightsync.naming import expert_converters, expert_stacks, map_names
from weightsync.stacking import ExpertStack, stack_expert_names
from weightsync.tiny import TinyModelConfig, build_model

CONVERTERS = [("mlp.experts.gate_up_proj", ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight")),
              ("mlp.experts.down_proj", ("mlp.experts.*.down_proj.weight",))]


def per_expert_names(layer: int, num_experts: int, prefix: str = "model.layers") -> list[str]:
    return [f"{prefix}.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(num_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")]


def test_names_group_into_fused_tensors_in_memory_order() -> None:
    names = ["model.embed_tokens.weight", *per_expert_names(0, 3), "model.layers.0.mlp.gate.weight"]
    stacks = stack_expert_names(names, CONVERTERS)
    assert stacks == (
        ExpertStack(hf_name="model.layers.0.mlp.experts.gate_up_proj", num_experts=3, num_parts=2, parts=tuple(
            f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(3) for p in ("gate", "up"))),
        ExpertStack(hf_name="model.layers.0.mlp.experts.down_proj", num_experts=3, num_parts=1, parts=tuple(
            f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(3))),
    )


def test_prefix_and_unmatched_names() -> None:
    # names outside the transformers model's prefix, and names no pattern matches, are left alone
    names = [*per_expert_names(0, 2, "language_model.model.layers"), *per_expert_names(0, 2, "vision.layers"),
             "language_model.model.layers.0.mlp.experts.0.gate_proj.bias",
             "language_model.model.layers.0.mlp.experts.01.gate_proj.weight"]
    # (a bias matches no pattern, and "01" is no expert index: both left out)
    stacks = stack_expert_names(names[:6] + names[12:], CONVERTERS, prefix="language_model.")
    assert [s.hf_name for s in stacks] == ["language_model.model.layers.0.mlp.experts.gate_up_proj",
                                           "language_model.model.layers.0.mlp.experts.down_proj"]
    assert all(s.num_experts == 2 for s in stacks)
    assert stack_expert_names(names[6:12], CONVERTERS, prefix="language_model.") == ()
    assert stack_expert_names(["model.layers.0.mlp.gate.weight"], []) == ()


@pytest.mark.parametrize(("left_out", "named"), [
    (["model.layers.1.mlp.experts.2.gate_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight",
      "model.layers.1.mlp.experts.2.down_proj.weight"],  # a whole expert lost
     ["model.layers.1.mlp.experts.gate_up_proj lacks", "model.layers.1.mlp.experts.down_proj lacks",
      "model.layers.1.mlp.experts.2.gate_proj.weight", "model.layers.1.mlp.experts.2.down_proj.weight"]),
    (["model.layers.1.mlp.experts.0.up_proj.weight"],  # a gate without its up
     ["model.layers.1.mlp.experts.gate_up_proj lacks 'model.layers.1.mlp.experts.0.up_proj.weight'"]),
])
def test_an_incomplete_set_is_refused_naming_the_missing(left_out: list[str], named: list[str]) -> None:
    names = [n for n in per_expert_names(0, 4) + per_expert_names(1, 4) if n not in left_out]
    with pytest.raises(NamingError) as refused:
        stack_expert_names(names, CONVERTERS)
    for text in named:
        assert text in str(refused.value)
    assert "layers.0" not in str(refused.value)  # the complete layer is not named
    assert "expert_layout='per-expert'" in str(refused.value)


def test_model_stacks_come_from_its_conversion_mapping() -> None:
    fused = build_model(TinyModelConfig(arch="qwen3_moe"))
    assert expert_converters(fused) == CONVERTERS
    assert expert_converters(torch.nn.Linear(2, 2)) == []
    assert expert_stacks(fused) == ()  # fused already: nothing to stack
    stacks = expert_stacks(per_expert_trainer(fused))
    assert [s.hf_name for s in stacks] == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                           for p in ("gate_up_proj", "down_proj")]
    assert all(s.num_experts == 8 for s in stacks)
    # a dense model of another architecture declares no expert conversion: its names are never stacked
    dense = build_model(TinyModelConfig(arch="qwen2"))
    dense.model.layers[0].mlp.experts = torch.nn.ModuleList(
        [torch.nn.ModuleDict({"gate_proj": torch.nn.Linear(2, 2), "up_proj": torch.nn.Linear(2, 2)})])
    assert expert_stacks(dense) == ()


def test_a_per_expert_mixtral_stacks_into_its_fused_tensors_and_names_its_checkpoint(tmp_path: Path) -> None:
    """Mixtral's patterns (`.experts.*.w1.weight`, `w3`, `w2`, anchored by a leading dot) stack a
    per-expert Mixtral into the `mlp.experts.gate_up_proj` / `down_proj` transformers holds; in the
    per-expert layout the same trainer goes under its checkpoint's names (`block_sparse_moe.`)."""
    fused = build_model(TinyModelConfig(arch="mixtral"))
    assert expert_converters(fused) == [
        ("experts.gate_up_proj", ("experts.*.w1.weight", "experts.*.w3.weight")),
        ("experts.down_proj", ("experts.*.w2.weight",))]
    trainer = per_expert_trainer(fused, MIXTRAL_PROJECTIONS)
    stacks = expert_stacks(trainer)
    assert [s.hf_name for s in stacks] == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                           for p in ("gate_up_proj", "down_proj")]
    assert stacks[0].parts[:3] == ("model.layers.0.mlp.experts.0.w1.weight", "model.layers.0.mlp.experts.0.w3.weight",
                                   "model.layers.0.mlp.experts.1.w1.weight")
    assert all(s.num_experts == 8 for s in stacks)
    fused.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    names = map_names(trainer, expert_layout="per-expert")
    assert set(names.hf_names) == set(saved)
    assert all(torch.equal(p.param, saved[p.hf_name]) for p in names.params)


def test_replicas_of_both_layouts_refuse_a_model_whose_experts_the_layout_names() -> None:
    from weightsync.push.planning import expert_layout

    fused = build_model(TinyModelConfig(arch="qwen3_moe"))
    both = {"vllm": "per-expert", "serve": "fused"}
    for model in (fused, per_expert_trainer(fused)):  # either way, the two would be sent different names
        with pytest.raises(ValueError, match="vllm loads per-expert, serve loads fused"):
            expert_layout(both, model)  # type: ignore[arg-type]
    assert expert_layout(both, build_model(TinyModelConfig(arch="qwen2"))) == "per-expert"  # type: ignore[arg-type]
