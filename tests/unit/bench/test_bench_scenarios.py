"""Bench scenarios: sizes by bytes, tensor counts, and the models they build."""

from __future__ import annotations

import pytest
import torch

from weightsync_tools.bench.scenarios import SCENARIOS, make_scenario, trainer_model, with_lora

MiB = 1 << 20


@pytest.mark.parametrize("name", SCENARIOS)
def test_sizes_and_counts_match_the_built_model(name: str) -> None:
    scenario = make_scenario(name, 4 * MiB)
    model = trainer_model(scenario)
    params = list(model.parameters())
    assert scenario.num_bytes == sum(p.numel() * p.element_size() for p in params)
    assert scenario.num_tensors == len(params)
    assert 2 * MiB < scenario.num_bytes < 6 * MiB


def test_many_small_has_many_more_tensors_per_byte() -> None:
    dense, small = make_scenario("dense", 512 * MiB), make_scenario("many-small", 512 * MiB)
    assert abs(dense.num_bytes - small.num_bytes) < 0.1 * dense.num_bytes
    per_byte = (small.num_tensors / small.num_bytes) / (dense.num_tensors / dense.num_bytes)
    assert per_byte > 10
    assert dense.model.hidden_size == 1024 and dense.model.num_layers >= 4


def test_same_seed_same_weights_and_lora_changes_the_merge() -> None:
    scenario = make_scenario("dense", 2 * MiB)
    a, b = trainer_model(scenario), trainer_model(scenario)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    peft_model = with_lora(b)
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # non-zero B: merged != base


def test_unknown_scenario_and_bad_size_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown scenario"):
        make_scenario("moe", MiB)
    with pytest.raises(ValueError, match="positive"):
        make_scenario("dense", 0)
