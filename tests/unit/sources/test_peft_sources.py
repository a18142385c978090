"""LoraSource and MergedLoraSource on plain PEFT models.

Every adapter starts with LoRA B non-zero (PEFT initialises it to zero, which
would make a merge a no-op), so each check below can fail.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from torch import nn

from weightsync.lora.source import LoraSource, MergedLoraSource
from weightsync.modes import make_source
from weightsync.sources import ModuleSource
from weightsync.tiny import TinyModelConfig, build_model

ALL_LINEAR = "all-linear"


def randomise_lora(model: nn.Module, seed: int = 0) -> None:
    """Seeded, non-zero values in every LoRA tensor (B included); trained copies of
    `modules_to_save` moved away from the originals."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype))
            elif ".modules_to_save." in name:
                p.add_((torch.randn(p.shape, generator=gen) * 0.01).to(p.dtype))


def peft_model(
    *, dtype: str = "float32", autocast_adapter_dtype: bool = True, seed: int = 0, **lora: object
) -> PeftModel:
    base = build_model(TinyModelConfig(num_layers=2, dtype=dtype, seed=seed))
    settings: dict[str, object] = dict(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=ALL_LINEAR)
    settings.update(lora)
    model = get_peft_model(base, LoraConfig(**settings), autocast_adapter_dtype=autocast_adapter_dtype)  # type: ignore[arg-type]
    randomise_lora(model, seed)
    return model.eval()


def snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Every parameter's value and storage address (a rebind would change the address)."""
    return {n: (p.detach().clone(), p.data_ptr()) for n, p in model.named_parameters()}


def assert_untouched(model: nn.Module, before: dict[str, tuple[torch.Tensor, int]]) -> None:
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (value, ptr) in before.items():
        assert after[name].data_ptr() == ptr, f"{name} was rebound"
        assert torch.equal(after[name], value), f"{name} was written"


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want) or set(got) == set(want), set(got) ^ set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), f"{name} differs"


TOKENS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64], [1, 2, 3, 4, 300, 301, 302, 511]])


# --- lora-merged -------------------------------------------------------------------


@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize(
    ("dtype", "autocast_adapter_dtype"),
    [("float32", True), ("bfloat16", True), ("bfloat16", False)],
    ids=["float32", "bfloat16-fp32-adapter", "bfloat16-bf16-adapter"],
)
def test_merged_stream_is_merge_and_unload_bit_for_bit(
    dtype: str, autocast_adapter_dtype: bool, use_rslora: bool
) -> None:
    model = peft_model(dtype=dtype, autocast_adapter_dtype=autocast_adapter_dtype, use_rslora=use_rslora,
                       modules_to_save=["lm_head"])
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    before = snapshot(model)

    source = MergedLoraSource(model)
    assert source.mode == "lora-merged"
    assert source.metas() == ModuleSource(model).metas()
    got = dict(source.tensors())

    assert_bit_equal(got, want)
    assert_untouched(model, before)
    base = build_model(TinyModelConfig(num_layers=2, dtype=dtype)).state_dict()
    changed = [n for n in got if not torch.equal(got[n], base[n])]
    assert len(changed) == 7 * 2 + 1, changed  # every LoRA'd linear, plus the trained lm_head copy


def test_merged_weights_give_the_peft_models_outputs() -> None:
    model = peft_model(use_rslora=True)
    plain = build_model(TinyModelConfig(num_layers=2))
    with torch.no_grad():
        base_logits = plain(TOKENS).logits
        plain.load_state_dict(dict(MergedLoraSource(model).tensors()), strict=True)
        merged_logits = plain(TOKENS).logits
        peft_logits = model(TOKENS).logits
    torch.testing.assert_close(merged_logits, peft_logits, rtol=1e-5, atol=1e-5)
    assert (merged_logits - base_logits).abs().max() > 1e-2


def test_merged_stream_follows_the_order_asked_and_refuses_unknown_names() -> None:
    model = peft_model()
    source = MergedLoraSource(model)
    names = [m.hf_name for m in source.metas()][::-1]
    assert [n for n, _ in source.tensors(names)] == names
    with pytest.raises(KeyError, match="'model.layers.9.mlp.up_proj.weight' is not a weight"):
        list(source.tensors(["model.layers.9.mlp.up_proj.weight"]))


@pytest.mark.parametrize(
    ("lora", "changed_name"),
    [
        ({"target_modules": ["embed_tokens", "q_proj"], "use_rslora": True}, "model.embed_tokens.weight"),
        ({"target_modules": ["q_proj", "v_proj"], "lora_bias": True}, "model.layers.1.self_attn.v_proj.bias"),
    ],
    ids=["embedding", "lora_bias"],
)
def test_merged_embedding_and_lora_bias(lora: dict[str, object], changed_name: str) -> None:
    model = peft_model(**lora)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    before = snapshot(model)
    got = dict(MergedLoraSource(model).tensors())
    assert_bit_equal(got, want)
    assert_untouched(model, before)
    base = build_model(TinyModelConfig(num_layers=2)).state_dict()
    assert not torch.equal(got[changed_name], base[changed_name])


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")
def test_lora_bias_without_a_base_bias_is_refused() -> None:
    model = peft_model(target_modules=["o_proj"], lora_bias=True)
    with pytest.raises(ValueError, match=r"'base_model.model.model.layers.0.self_attn.o_proj' has lora_bias=True"):
        MergedLoraSource(model)


def test_fan_in_fan_out_conv1d_model() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128, n_positions=32)).eval()
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    model = get_peft_model(base, config)
    randomise_lora(model)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    got = dict(MergedLoraSource(model).tensors())
    assert_bit_equal(got, {k: v for k, v in want.items() if k in got})
    assert set(want) - set(got) <= {"lm_head.weight"}  # tied to wte, sent once as in the checkpoint


def test_chosen_adapter_of_several() -> None:
    model = peft_model()
    model.add_adapter("other", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]))
    randomise_lora(model, seed=5)
    reference = copy.deepcopy(model)
    reference.set_adapter("other")
    want = reference.merge_and_unload().state_dict()
    got = dict(MergedLoraSource(model, adapter_name="other").tensors())
    assert_bit_equal(got, want)

    lora = LoraSource(model, adapter_name="other")
    assert [m.hf_name for m in lora.metas()] == list(get_peft_model_state_dict(model, adapter_name="other"))


def test_several_active_adapters_need_a_name() -> None:
    model = peft_model()
    model.add_adapter("other", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    model.base_model.set_adapter(["default", "other"])
    with pytest.raises(ValueError, match=r"2 adapters are active .*pass adapter_name="):
        MergedLoraSource(model)
    with pytest.raises(ValueError, match=r"no adapter 'missing'; adapters: \['default', 'other'\]"):
        LoraSource(model, adapter_name="missing")


# --- lora (adapter only) --------------------------------------------------------------


@pytest.mark.parametrize(
    "lora",
    [
        {},
        {"modules_to_save": ["lm_head"], "use_rslora": True},
        {"target_modules": ["q_proj", "k_proj"], "lora_bias": True},
    ],
    ids=["all-linear", "modules_to_save", "lora_bias"],
)
@pytest.mark.filterwarnings("ignore:Adapter 'default'.*invalid shape")  # PEFT misreads 1-D lora_B.bias
def test_lora_source_is_peft_state_dict(lora: dict[str, object]) -> None:
    model = peft_model(**lora)
    want = get_peft_model_state_dict(model)
    before = snapshot(model)
    source = make_source(model, "lora")
    assert isinstance(source, LoraSource) and source.mode == "lora"
    assert [m.hf_name for m in source.metas()] == list(want)
    assert [(m.dtype, m.shape) for m in source.metas()] == [(t.dtype, tuple(t.shape)) for t in want.values()]
    got = dict(source.tensors())
    assert list(got) == list(want)
    assert_bit_equal(got, want)
    assert all(t.abs().sum() > 0 for t in got.values())
    assert_untouched(model, before)


def test_lora_source_config_is_the_adapter_config() -> None:
    model = peft_model(use_rslora=True)
    config = LoraSource(model).config()
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["use_rslora"] is True and config["use_dora"] is False and config["bias"] == "none"
    assert config["target_modules"] == sorted(config["target_modules"])
    assert LoraConfig.from_peft_type(**config).to_dict()["r"] == 4


# --- what is refused ---------------------------------------------------------------------


@pytest.mark.parametrize("source_cls", [LoraSource, MergedLoraSource])
def test_dora_is_refused(source_cls: type) -> None:
    model = peft_model(use_dora=True)
    with pytest.raises(ValueError, match=r"uses DoRA \(use_dora=True\).*supported: plain LoRA"):
        source_cls(model)


@pytest.mark.parametrize("source_cls", [LoraSource, MergedLoraSource])
def test_other_tuners_are_refused(source_cls: type) -> None:
    base = build_model(TinyModelConfig(num_layers=1))
    model = get_peft_model(base, IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]))
    with pytest.raises(ValueError, match=r"adapter 'default' is a IA3 adapter; .*supports plain LoRA"):
        source_cls(model)


def test_lora_variants_are_refused_naming_the_module() -> None:
    model = peft_model(target_modules=["q_proj"], alora_invocation_tokens=[5, 6], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match=r"module '.*layers.0.self_attn.q_proj' .* LoRA variant ALoraLinearVariant"):
        MergedLoraSource(model)


def test_embedding_adapters_are_not_sent_alone() -> None:
    model = peft_model(target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(ValueError, match=r"'.*embed_tokens' .*leave embeddings out of target_modules"):
        LoraSource(model)


def test_trained_base_biases_are_not_sent_as_an_adapter() -> None:
    model = peft_model(bias="all")
    with pytest.raises(ValueError, match=r"trains base biases \(bias='all'\).*mode='lora-merged'"):
        LoraSource(model)
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert_bit_equal(dict(MergedLoraSource(model).tensors()), want)


def test_a_merged_model_is_refused() -> None:
    model = peft_model()
    model.merge_adapter()
    with pytest.raises(ValueError, match=r"already has adapters \['default'\] merged.*unmerge_adapter\(\)"):
        MergedLoraSource(model)


def test_a_plain_model_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM is not a PEFT model.*mode='full'"):
        MergedLoraSource(build_model(TinyModelConfig(num_layers=1)))
