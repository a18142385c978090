"""Trainer names -> checkpoint names, by walking the module tree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from weightsync.errors import NamingError
from weightsync.naming import ModelNames, ParamName, _check_unique, map_names, rename
from weightsync.tiny import TinyModelConfig, build_model


def checkpoint_keys(model: nn.Module, tmp_path: Path) -> set[str]:
    """The keys Hugging Face writes for `model` (tied weights appear once)."""
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.fixture(params=[("qwen2", False), ("qwen2", True), ("llama", False), ("llama", True)],
                ids=["qwen2", "qwen2-tied", "llama", "llama-tied"])
def model_and_keys(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[nn.Module, set[str]]:
    arch, tie = request.param
    model = build_model(TinyModelConfig(arch=arch, tie_word_embeddings=tie))
    return model, checkpoint_keys(model, tmp_path)


def test_plain_module_names_equal_checkpoint_keys(model_and_keys: tuple[nn.Module, set[str]]) -> None:
    model, keys = model_and_keys
    names = map_names(model, expected=keys)
    assert set(names.hf_names) == keys
    tied = model.config.tie_word_embeddings
    assert ("lm_head.weight" in names.hf_names) is (not tied)
    assert all(p.hf_name == p.trainer_name for p in names.params)


def test_compiled_module(model_and_keys: tuple[nn.Module, set[str]]) -> None:
    model, keys = model_and_keys
    compiled = torch.compile(model)
    assert any(n.startswith("_orig_mod.") for n, _ in compiled.named_parameters())
    names = map_names(compiled, expected=keys)
    assert set(names.hf_names) == keys
    assert all(p.trainer_name == "_orig_mod." + p.hf_name for p in names.params)


def test_compiled_submodules() -> None:
    model = build_model(TinyModelConfig())
    model.model.layers[0] = torch.compile(model.model.layers[0])
    names = map_names(model)
    assert "model.layers.0.mlp.up_proj.weight" in names.hf_names
    assert "model.layers.0._orig_mod.mlp.up_proj.weight" in {p.trainer_name for p in names.params}


def test_ddp_module(tmp_path: Path) -> None:
    model = build_model(TinyModelConfig())
    keys = checkpoint_keys(model, tmp_path)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        names = map_names(ddp, expected=keys)
        assert set(names.hf_names) == keys
        assert all(p.trainer_name == "module." + p.hf_name for p in names.params)
    finally:
        dist.destroy_process_group()


def test_peft_names_equal_base_checkpoint_keys(model_and_keys: tuple[nn.Module, set[str]]) -> None:
    from peft import LoraConfig, get_peft_model

    model, keys = model_and_keys
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    trainer_names = {n for n, _ in peft_model.named_parameters()}
    assert any(".base_layer." in n and n.startswith("base_model.model.") for n in trainer_names)
    assert any(".lora_A.default." in n for n in trainer_names)
    names = map_names(peft_model, expected=keys)
    assert set(names.hf_names) == keys
    layers = {a.hf_prefix for a in names.adapter_layers}
    assert "model.layers.0.self_attn.q_proj" in layers
    (q,) = [a for a in names.adapter_layers if a.hf_prefix == "model.layers.1.mlp.down_proj"]
    assert q.peft_prefix == "base_model.model.model.layers.1.mlp.down_proj"
    assert q.trainer_prefix == "base_model.model.model.layers.1.mlp.down_proj"


def test_peft_modules_to_save_sends_the_trained_copy(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    model = build_model(TinyModelConfig())
    keys = checkpoint_keys(model, tmp_path)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():
        peft_model.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    names = map_names(peft_model, expected=keys).by_hf_name()
    trained = peft_model.base_model.model.lm_head.modules_to_save["default"].weight
    assert names["lm_head.weight"].param is trained
    assert names["lm_head.weight"].trainer_name == "base_model.model.lm_head.modules_to_save.default.weight"


def test_a_name_named_like_a_wrapper_is_kept() -> None:
    """'module' and 'default' are real module names here, not wrapper segments."""
    model = nn.Module()
    model.module = nn.Linear(2, 2)
    model.default = nn.Linear(2, 2)
    assert set(map_names(model).hf_names) == {"module.weight", "module.bias", "default.weight", "default.bias"}


def test_unknown_wrapper_and_mismatched_names_are_errors(tmp_path: Path) -> None:
    model = build_model(TinyModelConfig())
    keys = checkpoint_keys(model, tmp_path)

    class Holder(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    with pytest.raises(NamingError, match=r"not in the checkpoint: 'inner\.lm_head\.weight'"):
        map_names(Holder(model), expected=keys)

    class DistributedDataParallel(nn.Module):  # a wrapper with weights of its own
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner
            self.extra = nn.Parameter(torch.zeros(1))

    with pytest.raises(NamingError, match="not reached while walking the module tree: 'extra'"):
        map_names(DistributedDataParallel(nn.Linear(2, 2)))

    with pytest.raises(NamingError, match="in the checkpoint but not in the model: 'model.extra.weight'"):
        map_names(model, expected=keys | {"model.extra.weight"})


def test_duplicate_names_are_errors() -> None:
    p = torch.zeros(1)
    names = ModelNames(params=(ParamName("w", "a.w", p), ParamName("w", "b.w", torch.ones(1))), adapter_layers=())
    with pytest.raises(NamingError, match=r"'w' <- \['a.w', 'b.w'\]"):
        _check_unique(names)


def test_fsdp1_is_refused_with_the_fix() -> None:
    class FullyShardedDataParallel(nn.Module):
        pass

    with pytest.raises(NamingError, match="use FSDP2"):
        map_names(FullyShardedDataParallel())


def test_rename_table() -> None:
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    assert rename(names, {"lm_head.weight": "output.weight"}) == {
        "model.embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "output.weight",
    }
    with pytest.raises(NamingError, match="match no weight: 'typo.weight'"):
        rename(names, {"typo.weight": "x"})
    with pytest.raises(NamingError, match="two weights to one name"):
        rename(names, {"lm_head.weight": "model.embed_tokens.weight"})
