"""`weightsync.integrations.trl` without TRL's trainer: the held source, the protocol's
order as `AsyncGRPOTrainer._sync_weight_merged` calls it, and what TRL's in-place
`merge_adapter()` / `unmerge_adapter()` does to float32 base weights (and how
`keep_base_exact` undoes it). TRL's trainer itself runs in tests/frameworks/test_trl.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import weightsync as ws
from memory_engine import MemoryEngine
from moe_models import MIXTRAL_PROJECTIONS, PROJECTIONS, per_expert_trainer
from weightsync.integrations.trl import HeldTensors, WeightTransfer
from weightsync.tiny import TinyModelConfig, build_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model() -> torch.nn.Module:
    """A float32 tiny Qwen2 with a real LoRA on every linear layer of its blocks (B non-zero)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(build_model(TinyModelConfig()), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    return model


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}


def changed(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> tuple[int, float]:
    """(elements that differ from `before`, their largest absolute difference)."""
    now = dict(model.named_parameters())
    diffs = [(now[n].detach() - w).abs() for n, w in before.items()]
    return sum(int((d > 0).sum()) for d in diffs), max(float(d.max()) for d in diffs)


def test_trl_merge_unmerge_round_trip_is_not_exact_in_float32() -> None:
    """What TRL does around every sync of a PEFT model, measured: the frozen base weights come
    back changed. Here 56,412 of 295,424 elements (19.1%), by at most 7.45e-9 (about one ulp of
    weights of magnitude up to 0.088), after one round trip; on a model whose adapter changes
    between syncs, as in training, the changes accumulate (100 syncs: 56.6% of elements, up to
    6.3e-8)."""
    model = peft_model()
    before = base_weights(model)
    inputs = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        adapted = model(inputs).logits
        with model.disable_adapter():
            base = model(inputs).logits
    assert not torch.allclose(adapted, base, atol=1e-4), "the LoRA changes the model"
    model.merge_adapter()
    with torch.no_grad():
        merged = model(inputs).logits
    assert torch.allclose(merged, adapted, atol=1e-5), "merged == unmerged, as PEFT promises"
    model.unmerge_adapter()
    num_changed, max_abs = changed(model, before)
    assert num_changed > 0 and 0 < max_abs < 1e-6, (num_changed, max_abs)


def test_keep_base_exact_restores_the_base_bit_for_bit() -> None:
    model = peft_model()
    before = base_weights(model)
    transfer = WeightTransfer(engines=[])
    transfer.keep_base_exact(model)
    for _ in range(3):  # as AsyncGRPOTrainer._sync_weight_merged calls it (send_weights left out)
        transfer.pause()
        model.merge_adapter()
        model.unmerge_adapter()
        transfer.resume()
        assert changed(model, before)[0] == 0
    # a failed sync: TRL skips resume() and calls destroy()
    transfer.pause()
    model.merge_adapter()
    model.unmerge_adapter()
    assert changed(model, before)[0] > 0
    transfer.destroy()
    assert changed(model, before)[0] == 0


def test_keep_base_exact_needs_a_lora_model() -> None:
    with pytest.raises(ValueError, match="has no LoRA layer"):
        WeightTransfer(engines=[]).keep_base_exact(build_model(TinyModelConfig()))


def named(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {"model.embed_tokens.weight": torch.randn(6, 4, generator=g), "model.norm.weight": torch.randn(4),
            "lm_head.weight": torch.randn(4, 6, generator=g).t()}


def test_held_tensors_keep_references_in_trls_order() -> None:
    weights = named(1)
    source = HeldTensors(iter(weights.items()))
    assert [m.hf_name for m in source.metas()] == list(weights)
    assert all(t is weights[n] for n, t in source.tensors(["lm_head.weight", "model.norm.weight"]))
    with pytest.raises(KeyError, match="'model.other' is not among the 3 weights TRL sent"):
        list(source.tensors(["model.other"]))
    with pytest.raises(ValueError, match="yielded 'a' twice"):
        HeldTensors(iter([("a", torch.zeros(1)), ("a", torch.zeros(1))]))


def test_each_send_is_a_verified_push_of_the_next_version() -> None:
    weights = named(1)
    engine = MemoryEngine({n: torch.zeros_like(t) for n, t in weights.items()})
    transfer = WeightTransfer(engines=[engine], transport="http", first_version=3)
    with pytest.raises(ws.WeightSyncError, match="send_weights before init_weight_transfer"):
        transfer.send_weights(iter(weights.items()))
    transfer.init_weight_transfer()
    for k in (1, 2):
        weights = named(k)
        transfer.pause()
        transfer.send_weights(iter(weights.items()))
        transfer.resume()
        assert engine.version == 2 + k
        assert all(torch.equal(engine.weights[n], t) for n, t in weights.items())
    assert [r.version for r in transfer.reports] == [3, 4] and transfer.next_version == 5
    transfer.destroy()


def test_a_refused_send_raises_and_the_version_is_not_spent() -> None:
    weights = named(1)
    engine = MemoryEngine({n: torch.zeros_like(t) for n, t in weights.items()})
    transfer = WeightTransfer(engines=[engine], transport="http")
    transfer.init_weight_transfer()
    engine.fail_receive_at = 0

    def trl_iterator() -> Iterator[tuple[str, torch.Tensor]]:
        yield from named(2).items()

    with pytest.raises(ws.EngineError, match="injected failure at bucket 0"):
        transfer.send_weights(trl_iterator())
    assert engine.version == 0 and transfer.next_version == 1 and transfer.reports == []
    engine.fail_receive_at = None
    transfer.send_weights(trl_iterator())
    assert engine.version == 1
    transfer.destroy()


def test_mode_is_not_an_option() -> None:
    with pytest.raises(ValueError, match="the mode is 'full'"):
        WeightTransfer(engines=[], mode="lora")


class PerExpertMemoryEngine(MemoryEngine):
    """Loads Mixture-of-Experts layers one tensor per expert, as vLLM declares."""

    def capabilities(self, timeout_s: float) -> ws.EngineCapabilities:
        return ws.EngineCapabilities(stages_updates=True, expert_layout="per-expert")


@pytest.mark.parametrize(("arch", "num_tensors"), [("qwen3_moe", 69), ("mixtral", 65)])
def test_fused_experts_from_trls_iterator_reach_a_per_expert_engine_bit_for_bit(arch: str, num_tensors: int) -> None:
    """TRL's own `_iter_vllm_named_params` yields a transformers-5 MoE model's experts fused;
    with `name_experts(model)` an engine that loads them per expert gets each as the checkpoint
    names it (as `save_pretrained` writes), bit for bit, and every other tensor too (Mixtral's
    router, `mlp.gate.weight` in the model, is `block_sparse_moe.gate.weight` there); without it
    the push is refused before any byte moves, naming the fused tensors and the call that fixes it."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    from weightsync.naming import map_names

    model = build_model(TinyModelConfig(arch=arch))
    checkpoint = {p.hf_name: p for p in map_names(model, expert_layout="per-expert").params}
    engine = PerExpertMemoryEngine({n: torch.zeros(p.expert.shape(tuple(p.param.shape)) if p.expert else p.param.shape)
                                    for n, p in checkpoint.items()})
    transfer = WeightTransfer(engines=[engine], transport="http")
    transfer.init_weight_transfer()
    with pytest.raises(ws.ManifestMismatchError) as refused:
        transfer.send_weights(_iter_vllm_named_params(model))
    assert "transfer.name_experts(trainer.model)" in str(refused.value.__notes__)
    assert "model.layers.0.mlp.experts.gate_up_proj" in str(refused.value)
    assert engine.version == 0 and transfer.next_version == 1
    transfer.name_experts(model)
    transfer.send_weights(_iter_vllm_named_params(model))
    transfer.destroy()
    assert engine.version == 1 and transfer.reports[0].num_tensors == len(checkpoint) == num_tensors
    for name, p in checkpoint.items():
        want = p.expert.of(p.param) if p.expert is not None else p.param
        assert torch.equal(engine.weights[name], want.detach()), name


def test_name_experts_needs_a_model_with_fused_experts() -> None:
    transfer = WeightTransfer(engines=[MemoryEngine({})], transport="http")
    with pytest.raises(ValueError, match="holds no Mixture-of-Experts parameters"):
        transfer.name_experts(build_model(TinyModelConfig()))


class FusedMemoryEngine(MemoryEngine):
    """Declares that it loads fused 3-D experts (as `weightsync serve` does)."""

    def capabilities(self, timeout_s: float) -> ws.EngineCapabilities:
        return ws.EngineCapabilities(stages_updates=True, expert_layout="fused")


def test_trls_iterator_leaves_the_router_bias_out_and_name_experts_sends_it() -> None:
    """TRL's `_iter_vllm_named_params` yields parameters only: a GLM-4.5-style router's
    `e_score_correction_bias` (a persistent buffer the engines load) is not among them, so
    the push is refused naming it and the fix; after `name_experts(model)` it is sent with
    the rest, bit for bit."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    model = build_model(TinyModelConfig(arch="glm4_moe"))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    engine = FusedMemoryEngine({n: torch.zeros_like(t) for n, t in model.state_dict().items()})
    transfer = WeightTransfer(engines=[engine], transport="http")
    transfer.init_weight_transfer()
    with pytest.raises(ws.ManifestMismatchError) as refused:
        transfer.send_weights(_iter_vllm_named_params(model))
    assert list(refused.value.missing) == [bias]
    assert "transfer.name_experts(trainer.model)" in str(refused.value.__notes__)
    assert engine.version == 0
    transfer.name_experts(model)
    transfer.send_weights(_iter_vllm_named_params(model))
    transfer.destroy()
    assert engine.version == 1
    for name, tensor in model.state_dict().items():
        assert torch.equal(engine.weights[name], tensor), name


@pytest.mark.parametrize(("arch", "projections"), [("qwen3_moe", PROJECTIONS), ("mixtral", MIXTRAL_PROJECTIONS)])
def test_per_expert_experts_from_trls_iterator_reach_a_fused_engine_bit_for_bit(
        arch: str, projections: tuple[str, str, str]) -> None:
    """A model holding its experts one by one (transformers 4's layout) sends them so through
    TRL's iterator; an engine that loads them fused (`weightsync serve`) refuses those names
    before any byte moves, naming them and the call that fixes it; after `name_experts(model)`
    it gets each layer's fused tensors, stacked in the stream, equal bit for bit to the
    transformers-5 model the per-expert one was split from (Mixtral's `w1`/`w3`/`w2` too)."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    fused = build_model(TinyModelConfig(arch=arch))
    trainer = per_expert_trainer(fused, projections)
    engine = FusedMemoryEngine({n: torch.zeros_like(t) for n, t in fused.state_dict().items()})
    transfer = WeightTransfer(engines=[engine], transport="http")
    transfer.init_weight_transfer()
    with pytest.raises(ws.ManifestMismatchError) as refused:
        transfer.send_weights(_iter_vllm_named_params(trainer))
    assert f"model.layers.0.mlp.experts.0.{projections[0]}.weight" in str(refused.value)
    assert "transfer.name_experts(trainer.model)" in str(refused.value.__notes__)
    assert engine.version == 0 and transfer.next_version == 1
    transfer.name_experts(trainer)
    transfer.send_weights(_iter_vllm_named_params(trainer))
    transfer.destroy()
    assert engine.version == 1 and transfer.reports[0].num_tensors == len(fused.state_dict())
    for name, tensor in fused.state_dict().items():
        assert torch.equal(engine.weights[name], tensor), name
