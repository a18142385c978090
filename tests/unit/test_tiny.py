"""Tiny models: loadable by transformers with an offline tokenizer, reproducible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from weightsync.tiny import TinyModelConfig, build_model, make_tiny_model


def test_tiny_model_dir_loads_offline(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("the policy is trained")["input_ids"]
    assert len(tok) == 512 and 0 < len(ids) < 20
    assert tok.decode(ids) == "the policy is trained"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    ref = build_model(TinyModelConfig())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True))
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512) and torch.isfinite(logits).all()


def test_every_tensor_carries_information() -> None:
    model = build_model(TinyModelConfig())
    for name, p in model.named_parameters():
        assert p.std() > 0, f"{name} is constant: a broken sync could not be told apart"


def test_bf16_and_llama(tmp_path: Path) -> None:
    out = make_tiny_model(tmp_path, TinyModelConfig(arch="llama", dtype="bfloat16", num_layers=1))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert json.loads((out / "weightsync_tiny.json").read_text())["dtype"] == "bfloat16"


def test_small_vocab_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 300"):
        make_tiny_model(tmp_path, TinyModelConfig(vocab_size=100))
