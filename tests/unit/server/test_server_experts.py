"""`server.experts.ExpertFuser`: per-expert checkpoint tensors (what SGLang's loaders read)
written into the fused expert parameters of transformers' Qwen3-MoE, any subset per call."""

from __future__ import annotations

import pytest
import torch

from weightsync.errors import ManifestMismatchError
from weightsync.server.experts import ExpertFuser
from weightsync.sources import ModuleSource
from weightsync.tiny import TinyModelConfig, build_model

CFG = TinyModelConfig(arch="qwen3_moe")
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


def test_experts_in_two_calls_rebuild_the_fused_tensor_and_refusals_name_the_expert() -> None:
    served = build_model(CFG)
    trained = build_model(TinyModelConfig(arch="qwen3_moe", seed=CFG.seed + 1))
    fuser = ExpertFuser(served)
    params = dict(served.named_parameters())
    stream = list(ModuleSource(trained).tensors())  # per-expert, as sent to SGLang
    assert fuser.names_experts([n for n, _ in stream]) and not fuser.names_experts(list(params))
    staged: dict[str, torch.Tensor] = {}
    cut = [n for n, _ in stream].index("model.layers.1.mlp.experts.4.up_proj.weight")
    for part in (stream[:cut], stream[cut:]):  # layer 1's experts (and expert 4's gate and up) split in two requests
        staged.update(fuser.fuse(part, lambda n: staged.get(n, params[n]), full=False))
    want = dict(trained.named_parameters())
    assert set(staged) == set(want) and all(torch.equal(staged[n], want[n]) for n in want)
    assert not torch.equal(params[GATE_UP], want[GATE_UP]), "the served model was not written"

    up = "model.layers.1.mlp.experts.5.up_proj.weight"
    with pytest.raises(ManifestMismatchError, match=r"experts\.5\.up_proj\.weight: sent \(64, 32\)") as e:
        fuser.fuse([(up, torch.zeros(64, 32))], params.__getitem__, full=False)
    assert e.value.mismatched == (up,)
    with pytest.raises(ManifestMismatchError, match="lacks 1 expert tensor") as e:
        fuser.fuse([(n, t) for n, t in stream if n != up], params.__getitem__, full=True)
    assert e.value.missing == (up,)
    with pytest.raises(ValueError, match=r"both the fused tensor and per-expert tensors of 'model\.layers\.1"):
        fuser.fuse([(up, dict(stream)[up]), (GATE_UP, want[GATE_UP])], params.__getitem__, full=False)
