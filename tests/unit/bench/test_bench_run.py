"""The bench machinery end to end on a tiny model: matrix cells, baselines, memory
and the CLI's JSON line. Figures are checked for consistency, never for speed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from weightsync.bucketing import plan_buckets
from weightsync.cli.main import main
from weightsync.modes import make_source
from weightsync_tools.bench import memory as memory_mod
from weightsync_tools.bench.baselines import run_baselines
from weightsync_tools.bench.engines import RunningEngine, start_engine
from weightsync_tools.bench.fixed_cost import SCENARIO as FIXED_COST
from weightsync_tools.bench.fixed_cost import run_fixed_cost
from weightsync_tools.bench.matrix import STAGES, Cell, engine_cells, run_cell
from weightsync_tools.bench.memory import measure_all
from weightsync_tools.bench.scenarios import (
    engine_model_dir,
    make_scenario,
    trainer_model,
    with_lora,
)
from weightsync_tools.bench.suite import BenchConfig, run_sync_suite

MiB = 1 << 20
SCENARIO = make_scenario("dense", 2 * MiB)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def engine(root: Path) -> Iterator[RunningEngine]:
    with start_engine("embedded", engine_model_dir(SCENARIO, root / "models"), disk_root=root) as running:
        yield running


@pytest.mark.parametrize("transport", ["http", "broadcast", "shm", "disk"])
def test_full_cell_figures_are_consistent(transport: str, engine: RunningEngine, root: Path) -> None:
    model = trainer_model(SCENARIO)
    cell = Cell(scenario="dense", mode="full", transport=transport, engine="embedded", bucket_bytes=MiB // 2)
    result = run_cell(cell, engine, model, repeats=2, versions_dir=root / "versions")
    assert result.ok and result.verified, result.error
    assert result.num_bytes == SCENARIO.num_bytes
    assert result.num_tensors == SCENARIO.num_tensors
    plan = plan_buckets(make_source(model).metas(), MiB // 2)
    assert result.num_buckets == len(plan) > 1
    assert len(result.runs) == 2 and result.seconds == min(result.runs)
    assert set(result.stages) == set(STAGES) and all(v >= 0 for v in result.stages.values())
    assert result.gbps == pytest.approx(result.num_bytes / result.seconds / 1e9)
    # every push makes round trips: at least begin and commit, and one per bucket unless on disk
    assert len(result.requests) == 2
    assert min(result.requests) >= 2 + (0 if transport == "disk" else result.num_buckets)


def test_lora_cell_moves_only_the_adapter(engine: RunningEngine, root: Path) -> None:
    model = with_lora(trainer_model(SCENARIO))
    cell = Cell(scenario="dense", mode="lora", transport="http", engine="embedded", bucket_bytes=MiB)
    result = run_cell(cell, engine, model, repeats=1, versions_dir=root / "versions")
    assert result.ok and result.verified, result.error
    adapter = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    assert result.num_bytes == adapter < SCENARIO.num_bytes


def test_fixed_cost_pushes_the_tiny_model_and_a_rank_1_adapter(root: Path) -> None:
    cells = run_fixed_cost("embedded", root=root, modes=["full", "lora", "lora-merged"], transports=["http", "shm"],
                           bucket_bytes=MiB, repeats=2)
    assert [(c.cell.mode, c.cell.transport) for c in cells] == [
        ("full", "http"), ("full", "shm"), ("lora", "http"), ("lora", "shm")]
    assert all(c.ok and c.verified and len(c.requests) == 2 and min(c.requests) >= 3 for c in cells), cells
    full, lora = cells[0], cells[2]
    assert (full.num_bytes, full.num_tensors, full.num_buckets) == (FIXED_COST.num_bytes, FIXED_COST.num_tensors, 1)
    assert (lora.num_bytes, lora.num_tensors) == (2 * 64 * 4, 2)  # rank-1 A and B on one 64-wide q_proj


def test_a_failing_cell_is_recorded_not_raised(engine: RunningEngine, tmp_path: Path) -> None:
    cell = Cell(scenario="dense", mode="full", transport="disk", engine="embedded", bucket_bytes=MiB)
    outside = tmp_path / "not-under-the-disk-root"
    result = run_cell(cell, engine, trainer_model(SCENARIO), repeats=1, versions_dir=outside, timeout_s=10)
    assert not result.ok and result.error and result.runs == ()


def test_cells_follow_what_the_engine_supports(engine: RunningEngine) -> None:
    cells = engine_cells("dense", engine, modes=["full", "lora"], transports=["http", "shm"],
                         bucket_sizes=[MiB, 2 * MiB])
    assert [(c.mode, c.transport, c.bucket_bytes) for c in cells] == [
        ("full", "http", MiB), ("full", "http", 2 * MiB), ("full", "shm", MiB), ("full", "shm", 2 * MiB),
        ("lora", "http", MiB), ("lora", "shm", MiB)]


def test_baselines_move_every_tensor(engine: RunningEngine, root: Path) -> None:
    runs = run_baselines(engine.url, trainer_model(SCENARIO), next_version=engine.next_version,
                         directory=root / "checkpoint")
    by_name = {b.name: b for b in runs}
    assert by_name["per-tensor-broadcast"].num_requests == SCENARIO.num_tensors
    assert by_name["per-tensor-http"].num_requests == SCENARIO.num_tensors
    assert set(by_name["checkpoint-reload"].parts) == {"save", "load"}
    assert all(b.num_bytes == SCENARIO.num_bytes and b.seconds > 0 for b in runs)
    assert not (root / "checkpoint").exists()
    assert engine.client.weight_version() == str(engine.next_version() - 1)  # each baseline was one version


@pytest.mark.slow
def test_layer_by_layer_merge_needs_less_memory_than_the_whole_model() -> None:
    config = make_scenario("dense", 24 * MiB).model.__dict__
    stream, whole = measure_all(dict(config), ("layer-by-layer", "whole-model"))
    assert stream.model_bytes == whole.model_bytes > 16 * MiB
    assert stream.peak_extra_bytes < whole.peak_extra_bytes
    assert whole.peak_extra_bytes > stream.model_bytes // 2  # the merged weights all exist at once


@pytest.mark.parametrize(("modes", "measured"), [(("full", "lora-merged"), True), (("full", "lora"), False)])
def test_the_suite_measures_merged_lora_memory_when_lora_merged_is_benched(
        modes: tuple[str, ...], measured: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory pass (`memory.measure_all`, run for real above) gets the dense scenario's
    model and the configured methods, and runs only when "lora-merged" is benched."""
    calls: list[tuple[dict[str, object], tuple[str, ...]]] = []
    measured_results = [object()]

    def measure_all(model_config: dict[str, object], methods: tuple[str, ...]) -> list[object]:
        calls.append((model_config, methods))
        return measured_results

    monkeypatch.setattr(memory_mod, "measure_all", measure_all)
    methods = ("layer-by-layer", "whole-model")
    config = BenchConfig(scenarios=("dense",), model_bytes=2 * MiB, bucket_sizes=(), modes=modes, engines=(),
                         baselines=(), fixed_cost_repeats=0, memory_methods=methods, out_dir=tmp_path)
    result = run_sync_suite(config)
    assert calls == ([(asdict(SCENARIO.model), methods)] if measured else [])
    assert result.memory == (measured_results if measured else [])


@pytest.mark.slow
def test_cli_prints_a_table_and_ends_with_one_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--quick", "--scenarios", "dense", "--model-bytes", "2MiB", "--bucket-bytes", "1MiB",
                 "--transports", "shm", "--modes", "full", "--repeats", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out.rstrip("\n").splitlines()
    assert code == 0
    assert any(line.startswith("sync matrix:") for line in out)
    doc = json.loads(out[-1])
    assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["torch"]
    assert [(c["mode"], c["transport"]) for c in doc["cells"]] == [("full", "shm")]
    assert {t["name"] for t in doc["targets"]} >= {"shm_vs_limit", "digest_share"}
    assert (tmp_path / "bench.png").is_file() and json.loads((tmp_path / "bench.json").read_text())["cells"]


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--transports", "carrier-pigeon"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["bench", "--model-bytes", "lots"])
