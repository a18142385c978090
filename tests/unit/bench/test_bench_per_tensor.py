"""The per-tensor suite: the 30,000-tensor scenario's size, each side's pass alone on a
small model, and the comparison with dense (its time scaled to the bytes)."""

from __future__ import annotations

from weightsync_tools.bench.per_tensor import (
    PerTensorResult,
    PushFigures,
    SideFigures,
    comparisons,
    engine_pass,
    format_table,
    trainer_pass,
)
from weightsync_tools.bench.scenarios import make_scenario, trainer_model

MiB = 1 << 20


def test_moe_30k_has_thirty_thousand_tensors_and_the_bytes_asked_for() -> None:
    big = make_scenario("moe-30k", 512 * MiB)
    assert big.num_tensors >= 30_000
    assert abs(big.num_bytes - 512 * MiB) < 0.05 * 512 * MiB
    small = make_scenario("moe-30k", 4 * MiB)  # no room: the narrowest MLP, more bytes than asked
    assert small.num_tensors == big.num_tensors and small.model.intermediate_size == 64


def test_each_side_alone_on_a_small_model() -> None:
    scenario = make_scenario("many-small", 4 * MiB)
    model = trainer_model(scenario)
    for figures in (trainer_pass(scenario, model, bucket_bytes=MiB, repeats=2),
                    engine_pass(scenario, model, bucket_bytes=MiB, repeats=2)):
        assert len(figures.runs) == 2 and figures.seconds == min(figures.runs) > 0
        assert figures.num_tensors == scenario.num_tensors and figures.manifest_bytes > 100 * scenario.num_tensors


def _push(scenario: str, transport: str, seconds: float, num_bytes: int, num_tensors: int) -> PushFigures:
    return PushFigures(scenario=scenario, transport=transport, num_tensors=num_tensors, num_bytes=num_bytes,
                       num_buckets=1, runs=(seconds, seconds + 1.0, seconds - 0.01), stages={}, verified=True,
                       peak_extra_bytes=MiB)


def test_comparisons_scale_dense_to_the_bytes_and_count_the_extra_tensors() -> None:
    result = PerTensorResult(model_bytes=100, bucket_bytes=10)
    result.pushes += [_push("dense", "shm", 0.10, 1000, 10), _push("moe-30k", "shm", 0.41, 2000, 3020)]
    result.sides += [SideFigures(scenario=s, side="trainer", num_tensors=n, num_bytes=b, runs=(t, t * 3),
                                 manifest_bytes=7)
                     for s, n, b, t in (("dense", 10, 1000, 0.1), ("moe-30k", 3020, 2000, 0.23))]
    by = {c["transport"]: c for c in comparisons(result)}
    shm, alone = by["shm"], by["trainer only"]
    assert abs(shm["dense_seconds_same_bytes"] - 0.2) < 1e-9 and abs(shm["ratio"] - 2.05) < 1e-9
    assert abs(shm["us_per_tensor"] - 0.21 / 3000 * 1e6) < 1e-6  # 3020 tensors, 20 of them dense's share
    assert abs(alone["us_per_tensor"] - 0.03 / 3000 * 1e6) < 1e-6 and alone["manifest_bytes"] == 7
    table = format_table(result)
    assert "reported  moe-30k over shm: ratio 2.05 (no ratio set for it;" in table
    assert "met  moe-30k, trainer only: 10.0 us" in table
    result.pushes.append(_push("many-small", "shm", 0.41, 2000, 3020))
    assert "NOT MET  many-small over shm: ratio 2.05 (<= 1.3;" in format_table(result)
