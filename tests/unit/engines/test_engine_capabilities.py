"""`EngineCapabilities` as engines serve it (`/weightsync/info` "capabilities"): the JSON
form pinned key for key, parsed back whole, defaults for what an older engine leaves
out; and the pause policy each engine's own mode names."""

from __future__ import annotations

import pytest
import torch

from weightsync import EngineCapabilities, PausePolicy

DECLARED = EngineCapabilities(
    num_ranks=2, dtype=torch.bfloat16, kept_dtypes={"layers.1.mlp.gate.e_score_correction_bias": torch.float32},
    stages_updates=True, pauses_at_commit=True, supports_delta=False,
    supports_sparse=True, adopts_shm=True, reads_digests=True, unloads_adapters=True, rolls_back=True,
    transports=frozenset({"shm", "http", "disk"}), lora_transports=frozenset({"http"}),
    fused_groups=(("q.weight", "k.weight", "v.weight"),), expert_layout="fused")


def test_the_json_form_is_pinned_and_parses_back_whole() -> None:
    assert DECLARED.to_dict() == {
        "num_ranks": 2, "dtype": "bfloat16", "kept_dtypes": {"layers.1.mlp.gate.e_score_correction_bias": "float32"},
        "stages_updates": True, "pauses_at_commit": True,
        "supports_delta": False, "supports_sparse": True, "adopts_shm": True, "reads_digests": True,
        "unloads_adapters": True, "rolls_back": True, "transports": ["disk", "http", "shm"],
        "lora_transports": ["http"], "fused_groups": [["q.weight", "k.weight", "v.weight"]],
        "expert_layout": "fused",
    }
    assert EngineCapabilities.from_dict(DECLARED.to_dict()) == DECLARED
    assert "fused_groups" not in EngineCapabilities().to_dict()  # left out when there are none
    assert "kept_dtypes" not in EngineCapabilities().to_dict()


def test_what_an_engine_leaves_out_takes_the_defaults_and_unknown_keys_are_ignored() -> None:
    assert EngineCapabilities.from_dict({}) == EngineCapabilities()
    assert EngineCapabilities.from_dict({"supports_delta": True, "a_newer_capability": 1}) == EngineCapabilities()
    assert EngineCapabilities().supports_delta and not EngineCapabilities().supports_sparse
    with pytest.raises(ValueError, match=r"unknown expert_layout 'stacked'; one of \['per-expert', 'fused'\]"):
        EngineCapabilities.from_dict({"expert_layout": "stacked"})


@pytest.mark.parametrize(("policy", "sglang", "vllm"), [
    ("none", None, None), ("abort", "abort", "abort"), ("retract", "retract", "wait"), ("in_place", "in_place", "keep"),
])
def test_each_pause_policy_names_each_engines_own_mode(policy: str, sglang: str | None, vllm: str | None) -> None:
    assert (PausePolicy(policy).sglang_mode, PausePolicy(policy).vllm_mode) == (sglang, vllm)
