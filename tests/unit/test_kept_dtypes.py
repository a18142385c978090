"""Tensors an engine keeps in another dtype than it serves (`EngineCapabilities.kept_dtypes`):
a bfloat16 GLM-4.5 or DeepSeek-V3 keeps its routers' `e_score_correction_bias` (vLLM also
the router weight) in float32. A float32 trainer's push casts every other floating tensor
to the engine's dtype and sends those in their own, so the engine holds the master's
values exactly; replicas that keep different tensors are refused before any byte moves.
`Cast` is the record of what each tensor travels in. Against `MemoryEngine` (the real
receiving code, weights in a dict); tests/integration/test_moe_serve.py and
test_moe_vllm_glm.py run the same against `weightsync serve` and vLLM."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import weightsync as ws
from memory_engine import MemoryEngine
from weightsync.dtypes import Cast
from weightsync.engines.base import EngineCapabilities

KEPT = "1.bias"


class KeepingEngine(MemoryEngine):
    """A bfloat16 engine that keeps `kept` (engine names) in float32."""

    def __init__(self, weights: dict[str, torch.Tensor], kept: dict[str, torch.dtype], **kw: Any) -> None:
        super().__init__({n: t.to(kept.get(n, torch.bfloat16)) for n, t in weights.items()}, **kw)
        self.kept = kept

    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        return EngineCapabilities(stages_updates=True, dtype=torch.bfloat16, kept_dtypes=self.kept)


def trainer() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    with torch.no_grad():
        model[1].bias.add_(1e-3 / 3)  # not a bfloat16 value: a cast would change it
    return model


def test_cast_names_each_tensors_dtype_and_round_trips() -> None:
    cast = Cast(to=torch.bfloat16, kept={KEPT: torch.float32})
    assert cast.of("0.weight", torch.float32) == torch.bfloat16
    assert cast.of(KEPT, torch.float32) == torch.float32
    assert cast.of(KEPT, torch.bfloat16) == torch.float32  # a bf16 trainer's copy goes up, exactly
    assert cast.of("steps", torch.int64) == torch.int64  # never cast
    assert Cast().of("0.weight", torch.float32) == torch.float32
    assert Cast.from_dict(cast.to_dict()) == cast
    assert Cast.from_dict(None) == Cast()


def test_a_float32_trainer_reaches_kept_tensors_exactly() -> None:
    model = trainer()
    engine = KeepingEngine({n: torch.zeros_like(t) for n, t in model.state_dict().items()}, {KEPT: torch.float32})
    with ws.WeightSync([engine], transport="http") as sync:
        report = sync.push(model, version=1)
    assert report.verified
    assert any(f"sent in float32, as the engines keep them: '{KEPT}'" in n for n in report.notes), report.notes
    assert any("cast from float32 to bfloat16" in n for n in report.notes)
    for name, tensor in model.state_dict().items():
        want = tensor if name == KEPT else tensor.to(torch.bfloat16)
        assert engine.weights[name].dtype == want.dtype and torch.equal(engine.weights[name], want), name


def test_kept_names_are_the_engines_under_a_rename_table() -> None:
    model = trainer()
    held = {n.replace("1.", "head."): torch.zeros_like(t) for n, t in model.state_dict().items()}
    engine = KeepingEngine(held, {"head.bias": torch.float32})
    with ws.WeightSync([engine], transport="http", rename={"1.weight": "head.weight", "1.bias": "head.bias"}) as sync:
        assert sync.push(model, version=1).verified
    assert torch.equal(engine.weights["head.bias"], model[1].bias.detach())
    assert engine.weights["head.weight"].dtype == torch.bfloat16


def test_replicas_keeping_different_tensors_are_refused_before_any_byte_moves() -> None:
    model = trainer()
    zeros = {n: torch.zeros_like(t) for n, t in model.state_dict().items()}
    engines = [KeepingEngine(zeros, {KEPT: torch.float32}, label="keeps-bias"),
               KeepingEngine(zeros, {}, label="keeps-none")]
    with ws.WeightSync(engines, transport="http") as sync, pytest.raises(
            ws.CastError, match=r"keeps-bias keeps 1\.bias in float32; keeps-none keeps none"):
        sync.push(model, version=1)
    assert all(e.version == 0 and "begin" not in " ".join(e.calls) for e in engines)


def test_an_engine_refuses_a_kept_tensor_sent_in_the_served_dtype() -> None:
    """A client that casts every floating tensor (forcing one dtype is no excuse: the kept
    ones still go in their own) meets the dry run, naming the tensor and both dtypes."""
    model = trainer()
    engine = KeepingEngine({n: torch.zeros_like(t) for n, t in model.state_dict().items()}, {KEPT: torch.float32})
    with ws.WeightSync([engine], transport="http", dtype=torch.bfloat16) as sync:
        assert sync.push(model, version=1).verified  # dtype= forces the served dtype, not the kept ones
    assert engine.weights[KEPT].dtype == torch.float32

    class Forgetful(KeepingEngine):
        def capabilities(self, timeout_s: float) -> EngineCapabilities:
            return EngineCapabilities(stages_updates=True, dtype=torch.bfloat16)  # says nothing of what it keeps

    forgetful = Forgetful({n: torch.zeros_like(t) for n, t in model.state_dict().items()}, {KEPT: torch.float32})
    with ws.WeightSync([forgetful], transport="http") as sync, pytest.raises(
            ws.ManifestMismatchError, match=r"1\.bias: sent \(4,\) torch\.bfloat16, engine has \(4,\) torch\.float32"):
        sync.push(model, version=1)
    assert forgetful.version == 0
