"""Derived figures, targets and output formats, on a hand-made result (no timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weightsync_tools.bench.analysis import cell_views, floors, targets
from weightsync_tools.bench.baselines import BaselineResult
from weightsync_tools.bench.limits import Limit
from weightsync_tools.bench.matrix import STAGES, Cell, CellResult
from weightsync_tools.bench.memory import MemoryResult
from weightsync_tools.bench.report import format_report, to_json, write_chart
from weightsync_tools.bench.scenarios import make_scenario
from weightsync_tools.bench.suite import BenchConfig, BenchResult

MiB = 1 << 20
N = 100 * MiB


def _cell(scenario: str, mode: str, transport: str, seconds: float, *, hash_s: float = 0.01,
          nbytes: int = N) -> CellResult:
    cell = Cell(scenario=scenario, mode=mode, transport=transport, engine="embedded", bucket_bytes=MiB)
    stages = dict.fromkeys(STAGES, 0.0) | {"hash": hash_s}
    return CellResult(cell=cell, num_bytes=nbytes, num_tensors=10, num_buckets=4, runs=(seconds * 1.5, seconds),
                      stages=stages, verified=True)


def _limits(**seconds: float) -> dict[str, Limit]:
    return {name: Limit(name=name, num_bytes=N, chunk_bytes=MiB, runs=(s,)) for name, s in seconds.items()}


@pytest.fixture
def result(tmp_path: Path) -> BenchResult:
    res = BenchResult(config=BenchConfig(out_dir=tmp_path), machine={"cpu_count": 2, "torch": "x"})
    res.scenarios = [make_scenario("dense", 2 * MiB), make_scenario("many-small", 2 * MiB)]
    res.limits = {("dense", MiB): _limits(gloo=0.1, copy=0.06, xxh3=0.01, tcp=0.05, disk=0.5),
                  ("many-small", MiB): _limits(gloo=0.1, copy=0.06, xxh3=0.01, tcp=0.05, disk=0.5)}
    failed = Cell(scenario="dense", mode="full", transport="disk", engine="embedded", bucket_bytes=MiB)
    res.cells = [
        _cell("dense", "full", "broadcast", 0.2),
        _cell("dense", "full", "shm", 0.1),
        _cell("dense", "lora", "shm", 0.004, nbytes=MiB),
        _cell("dense", "lora", "broadcast", 0.02, nbytes=MiB),
        _cell("many-small", "full", "shm", 0.2),
        CellResult(cell=failed, error="EngineError: boom"),
    ]
    res.baselines = {
        "dense": [BaselineResult(name="checkpoint-reload", num_bytes=N, num_requests=1, seconds=0.5,
                                 parts={"save": 0.2, "load": 0.3})],
        "many-small": [BaselineResult(name="per-tensor-broadcast", num_bytes=N, num_requests=400, seconds=3.0),
                       BaselineResult(name="per-tensor-http", num_bytes=N, num_requests=400, seconds=2.0)],
    }
    tiny = Cell(scenario="fixed-cost", mode="lora", transport="http", engine="embedded", bucket_bytes=MiB)
    res.fixed_cost = [CellResult(cell=tiny, num_bytes=512, num_tensors=2, num_buckets=1, runs=(0.009, 0.008),
                                 verified=True, requests=(5, 6))]
    res.memory = [MemoryResult(method="layer-by-layer", model_bytes=N, base_rss_bytes=N, peak_extra_bytes=MiB,
                               largest_tensor_bytes=MiB)]
    return res


def test_fraction_of_limit_speedups_and_digest_share(result: BenchResult) -> None:
    views = {(v.result.cell.scenario, v.result.cell.mode, v.result.cell.transport): v for v in cell_views(result)}
    bcast = views[("dense", "full", "broadcast")]
    assert (bcast.limit_name, bcast.limit_fraction) == ("gloo", pytest.approx(0.5))
    assert bcast.speedups == {"checkpoint-reload": pytest.approx(2.5)}
    assert bcast.digest_share == pytest.approx((0.01 + 0.01) / 0.2)  # trainer hash + engine re-hash at xxh3 rate
    assert views[("dense", "full", "shm")].limit_fraction == pytest.approx(0.6)
    assert views[("dense", "full", "disk")].limit_fraction is None  # failed cells get no figures


def test_targets_are_judged_not_asserted(result: BenchResult) -> None:
    found = {t.name: t for t in targets(result, cell_views(result))}
    assert found["broadcast_vs_limit"].met is False and found["broadcast_vs_limit"].verdict == "NOT MET"
    assert found["shm_vs_limit"].met is True
    assert found["many-small_vs_per_tensor"].measured == pytest.approx(2.0 / 0.2)  # fastest baseline counts
    assert found["dense_vs_checkpoint_reload"].measured == pytest.approx(0.5 / 0.1)
    lora = found["lora_vs_full"]
    assert lora.measured == pytest.approx(0.02 / 0.2) and lora.met is False  # the worst transport counts
    assert "shm 4.0%" in lora.detail
    assert found["digest_share"].measured == pytest.approx(0.2)


def test_work_floor_from_the_same_runs_limits(result: BenchResult) -> None:
    found = {(f.scenario, f.transport): f for f in floors(result, cell_views(result))}
    shm = found[("dense", "shm")]  # copy 0.06, xxh3 0.01: pack + hash, and the engine's hash in place
    assert shm.stages == {"pack": 0.06, "hash": 0.01, "engine hash": 0.01}
    assert (shm.serial, shm.overlapped) == (pytest.approx(0.08), pytest.approx(0.07))
    bcast = found[("dense", "broadcast")]  # the move (gloo 0.1) counts on both sides
    assert bcast.overlapped == pytest.approx(0.06 + 0.01 + 0.1)
    assert ("dense", "http") not in found  # no full http cell in this result


def test_missing_parts_are_not_measured(tmp_path: Path) -> None:
    empty = BenchResult(config=BenchConfig(out_dir=tmp_path), machine={})
    assert {t.verdict for t in targets(empty, [])} == {"not measured"}


def test_table_json_line_and_chart(result: BenchResult, tmp_path: Path) -> None:
    text = format_report(result)
    for section in ("sync matrix:", "machine limits", "baselines", "fixed cost of a push", "trainer peak memory",
                    "targets (", "work floor", "FAILED"):
        assert section in text
    fixed_row = next(line.split() for line in text.splitlines() if line.lstrip().startswith("embedded  lora"))
    assert fixed_row[-4:] == ["8.0", "8.5", "5-6", "yes"]  # fastest ms, median ms, requests per push
    line = json.dumps(to_json(result))
    assert "\n" not in line
    doc = json.loads(line)
    assert {c["transport"] for c in doc["cells"]} == {"broadcast", "shm", "disk"}
    assert {t["name"] for t in doc["targets"]} >= {"broadcast_vs_limit", "digest_share"}
    assert doc["cells"][0]["stages"].keys() == set(STAGES)
    assert [(c["mode"], c["requests"], c["seconds"]) for c in doc["fixed_cost"]] == [("lora", [5, 6], 0.008)]
    chart = write_chart(result, tmp_path / "out" / "bench.png")
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
