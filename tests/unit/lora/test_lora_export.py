"""export_lora_adapter writes what PEFT's save_pretrained writes, and PEFT loads it.

Every adapter starts with LoRA B non-zero, so a lost or misnamed tensor shows
in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from torch import nn

from weightsync.lora import CONFIG_NAME, WEIGHTS_NAME, adapter_config, export_lora_adapter
from weightsync.tiny import TinyModelConfig, build_model

TOKENS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64], [1, 2, 3, 4, 300, 301, 302, 511]])


def peft_model(*, dtype: str = "float32", **lora: object) -> PeftModel:
    base = build_model(TinyModelConfig(num_layers=2, dtype=dtype))
    settings: dict[str, object] = dict(r=4, lora_alpha=8, lora_dropout=0.05, target_modules="all-linear")
    settings.update(lora)
    model = get_peft_model(base, LoraConfig(**settings))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype))
            elif ".modules_to_save." in name:
                p.add_((torch.randn(p.shape, generator=gen) * 0.01).to(p.dtype))
    return model.eval()


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize(
    "lora",
    [{}, {"use_rslora": True, "modules_to_save": ["lm_head"]}, {"target_modules": ["q_proj", "v_proj"]}],
    ids=["all-linear", "rslora-modules_to_save", "some-modules"],
)
def test_peft_loads_the_export_with_equal_logits(tmp_path: Path, lora: dict[str, object]) -> None:
    model = peft_model(**lora)
    out = export_lora_adapter(model, tmp_path / "adapter")
    assert out == tmp_path / "adapter"
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]

    loaded = PeftModel.from_pretrained(build_model(TinyModelConfig(num_layers=2)), out).eval()
    assert torch.equal(logits(loaded), logits(model))
    base_logits = logits(build_model(TinyModelConfig(num_layers=2)))
    assert (logits(loaded) - base_logits).abs().max() > 1e-2


def test_files_match_peft_save_pretrained(tmp_path: Path) -> None:
    model = peft_model(use_rslora=True, modules_to_save=["lm_head"])
    ours = export_lora_adapter(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "peft")
    theirs = tmp_path / "peft"

    got, want = load_file(ours / WEIGHTS_NAME), load_file(theirs / WEIGHTS_NAME)
    assert got.keys() == want.keys()
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert not any(".default." in k or ".base_layer." in k for k in got)

    got_config = json.loads((ours / CONFIG_NAME).read_text())
    want_config = json.loads((theirs / CONFIG_NAME).read_text())
    want_config["target_modules"] = sorted(want_config["target_modules"])
    assert got_config == want_config
    assert got_config == adapter_config(model)


def test_config_round_trips_through_lora_config(tmp_path: Path) -> None:
    model = peft_model(use_rslora=True, lora_alpha=16, r=8, lora_dropout=0.1)
    out = export_lora_adapter(model, tmp_path, base_model_name_or_path="org/tiny-qwen2")
    config = json.loads((out / CONFIG_NAME).read_text())
    for key, value in {"r": 8, "lora_alpha": 16, "use_rslora": True, "use_dora": False, "bias": "none",
                       "peft_type": "LORA", "fan_in_fan_out": False, "lora_dropout": 0.1,
                       "modules_to_save": None, "task_type": None, "inference_mode": True,
                       "base_model_name_or_path": "org/tiny-qwen2"}.items():
        assert config[key] == value, key
    loaded = PeftConfig.from_pretrained(str(out))
    assert isinstance(loaded, LoraConfig)
    original = model.peft_config["default"].to_dict()
    for key, value in loaded.to_dict().items():
        if key not in ("inference_mode", "base_model_name_or_path", "auto_mapping"):
            assert value == original[key], key
    assert LoraConfig(**{k: v for k, v in config.items() if k not in ("peft_type", "auto_mapping")}).r == 8


def test_bfloat16_adapter_keeps_its_dtype(tmp_path: Path) -> None:
    model = peft_model(dtype="bfloat16")
    tensors = load_file(export_lora_adapter(model, tmp_path) / WEIGHTS_NAME)
    adapter_dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert {t.dtype for t in tensors.values()} == adapter_dtypes


def test_write_false_writes_nothing(tmp_path: Path) -> None:
    out = export_lora_adapter(peft_model(), tmp_path / "not-here", write=False)
    assert out == tmp_path / "not-here" and not out.exists()


def test_dora_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"uses DoRA \(use_dora=True\)"):
        export_lora_adapter(peft_model(use_dora=True), tmp_path)
    assert list(tmp_path.iterdir()) == []
