"""Benchmark scenarios: which model shape the bench moves ("dense", "many-small", "moe-30k"), sized
by bytes.

All plain Qwen2 configs (`weightsync.tiny`), so the embedded engine and vLLM load them end to end.
Decides shapes and builds models (trainer copy in memory, engine copy on disk); moves no weights
and times nothing. Why these shapes: docs/PERFORMANCE.md ("How the bench measures").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from weightsync.tiny import HEAD_DIM, TinyModelConfig

SCENARIOS = ("dense", "many-small")
"""What the sync suite runs by default."""
ALL_SCENARIOS = (*SCENARIOS, "moe-30k")
MOE_LAYERS = 2500
"""Layers of "moe-30k": 12 tensors each, 30,003 in all."""
MANY_SMALL_NOTE = ("many-small stands in for a MoE (thousands of small expert matrices) with a loadable "
                   "thin, deep Qwen2: transformers 5 fuses each layer's experts into one 3-D tensor, so an "
                   "HF-loadable MoE has few tensors")
DEFAULT_MODEL_BYTES = 512 << 20
LORA_RANK = 16
LORA_TARGETS = "all-linear"


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """A named model shape of a given size."""

    name: str
    """One of ALL_SCENARIOS."""
    model: TinyModelConfig
    """The Qwen2 config built for it."""

    @property
    def num_bytes(self) -> int:
        """Bytes of all weights (what a full sync moves)."""
        return qwen2_num_bytes(self.model)

    @property
    def num_tensors(self) -> int:
        """Tensors a full sync moves."""
        per_layer = 12  # q/k/v weight+bias, o, gate, up, down, two norms
        return self.model.num_layers * per_layer + 2 + (0 if self.model.tie_word_embeddings else 1)

    def describe(self) -> str:
        cfg = self.model
        return (f"{self.name}: Qwen2 {cfg.num_layers} layers x hidden {cfg.hidden_size}, "
                f"intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}, {cfg.dtype}; "
                f"{self.num_tensors} tensors, {self.num_bytes / 2**20:.0f} MiB")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_bytes": self.num_bytes, "num_tensors": self.num_tensors,
                "model": asdict(self.model)}


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def qwen2_layer_params(cfg: TinyModelConfig) -> int:
    """Parameters of one Qwen2 decoder layer (q/k/v carry biases)."""
    hidden = cfg.hidden_size
    kv = cfg.num_kv_heads * HEAD_DIM
    attention = (hidden * hidden + hidden) + 2 * (kv * hidden + kv) + hidden * hidden
    mlp = 3 * hidden * cfg.intermediate_size
    return attention + mlp + 2 * hidden


def qwen2_num_bytes(cfg: TinyModelConfig) -> int:
    """Bytes of every weight of a Qwen2 model built from `cfg`."""
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    params = embeddings + cfg.num_layers * qwen2_layer_params(cfg) + cfg.hidden_size
    return params * _itemsize(cfg.dtype)


def _fit_layers(base: TinyModelConfig, model_bytes: int) -> TinyModelConfig:
    """`base` with as many layers as fit `model_bytes` (at least one)."""
    fixed = qwen2_num_bytes(replace(base, num_layers=0))
    per_layer = qwen2_layer_params(base) * _itemsize(base.dtype)
    return replace(base, num_layers=max(1, round((model_bytes - fixed) / per_layer)))


def dense_config(model_bytes: int) -> TinyModelConfig:
    """The widest of a few Qwen2 widths that still gets at least 4 layers."""
    for heads in (16, 8, 4, 2):
        hidden = heads * HEAD_DIM
        base = TinyModelConfig(num_layers=1, num_heads=heads, num_kv_heads=max(1, heads // 4),
                               intermediate_size=_round64(2.75 * hidden), vocab_size=max(1024, 8 * hidden))
        cfg = _fit_layers(base, model_bytes)
        if cfg.num_layers >= 4:
            return cfg
    return cfg


def many_small_config(model_bytes: int) -> TinyModelConfig:
    """Thin layers (hidden 128, MLP matrices of 512 KB), as many as fit."""
    base = TinyModelConfig(num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=1024, vocab_size=1024)
    return _fit_layers(base, model_bytes)


def moe_30k_config(model_bytes: int) -> TinyModelConfig:
    """MOE_LAYERS layers of hidden 64, the MLP as wide as `model_bytes` allows (at least 64)."""
    base = TinyModelConfig(num_layers=MOE_LAYERS, num_heads=1, num_kv_heads=1, intermediate_size=64,
                           vocab_size=1024)
    per_unit = MOE_LAYERS * 3 * base.hidden_size * _itemsize(base.dtype)  # bytes per unit of intermediate
    room = model_bytes - qwen2_num_bytes(replace(base, intermediate_size=0))
    return replace(base, intermediate_size=max(64, room // per_unit))


def _round64(x: float) -> int:
    return max(64, round(x / 64) * 64)


def make_scenario(name: str, model_bytes: int = DEFAULT_MODEL_BYTES) -> Scenario:
    """The scenario `name` sized to about `model_bytes` of weights."""
    if model_bytes <= 0:
        raise ValueError(f"model_bytes must be positive, got {model_bytes}")
    if name == "dense":
        return Scenario(name=name, model=dense_config(model_bytes))
    if name == "many-small":
        return Scenario(name=name, model=many_small_config(model_bytes))
    if name == "moe-30k":
        return Scenario(name=name, model=moe_30k_config(model_bytes))
    raise ValueError(f"unknown scenario {name!r}; one of {ALL_SCENARIOS}")


def engine_model_dir(scenario: Scenario, root: Path) -> Path:
    """A model directory for the engines, written once under `root` and reused
    while its config is unchanged."""
    from weightsync.tiny import make_tiny_model

    out = root / f"{scenario.name}-{scenario.num_bytes >> 20}MiB"
    marker = out / "weightsync_tiny.json"
    if marker.is_file() and json.loads(marker.read_text()) == asdict(scenario.model):
        return out
    return make_tiny_model(out, scenario.model)


def trainer_model(scenario: Scenario) -> Any:
    """The trainer's copy: same seed, so the same weights as `engine_model_dir`."""
    from weightsync.tiny import build_model

    return build_model(scenario.model)


def with_lora(model: Any, *, rank: int = LORA_RANK, seed: int = 0,
              target_modules: str | list[str] = LORA_TARGETS) -> Any:
    """`model` wrapped in a PEFT LoRA adapter of rank `rank` on `target_modules`
    (default every linear layer), with B initialised non-zero (so merged weights
    differ from the base)."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target_modules,
                                                  lora_dropout=0.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 1e-3)
    return peft_model
