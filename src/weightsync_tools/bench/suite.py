"""The sync suite: for each scenario, the machine's limits, the matrix of syncs, the baselines, the
fixed cost of a push and (once) the trainer's peak memory, all in one run.

Orchestration and bookkeeping only: every measurement lives in `limits`, `matrix`, `fixed_cost`,
`baselines` and `memory`, every judgement in `report`. The run's order and what runs where:
docs/PERFORMANCE.md ("How the bench measures").
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from weightsync.transports import TRANSPORTS
from weightsync_tools.bench import Progress
from weightsync_tools.bench import baselines as baselines_mod
from weightsync_tools.bench import fixed_cost as fixed_cost_mod
from weightsync_tools.bench import limits as limits_mod
from weightsync_tools.bench import memory as memory_mod
from weightsync_tools.bench.engines import start_engine
from weightsync_tools.bench.matrix import MODES, CellResult, engine_cells, run_engine_cells
from weightsync_tools.bench.scenarios import (
    DEFAULT_MODEL_BYTES,
    SCENARIOS,
    Scenario,
    engine_model_dir,
    make_scenario,
)

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What `weightsync bench --suite sync` runs."""

    scenarios: tuple[str, ...] = SCENARIOS
    """Model shapes, see `bench.scenarios`."""
    model_bytes: int = DEFAULT_MODEL_BYTES
    """Bytes of weights of every scenario's model."""
    bucket_sizes: tuple[int, ...] = (16 * MiB, 64 * MiB, 256 * MiB)
    """Bucket sizes of the matrix (the first one is used where only one is run)."""
    modes: tuple[str, ...] = MODES
    """Sync modes ("many-small" runs "full" only)."""
    transports: tuple[str, ...] = TRANSPORTS
    """Transports (each engine runs those it supports)."""
    engines: tuple[str, ...] = ("embedded",)
    """"embedded" and/or "vllm"."""
    repeats: int = 3
    """Measured pushes per cell (after one warm-up push); the fastest counts."""
    engine_dtype: str = "float32"
    """The dtype the engines serve; the trainer's model stays float32 and every push casts
    its floating tensors in the stream ("bfloat16": the usual RL setup)."""
    limit_repeats: int = 3
    """Runs per limit; the fastest counts."""
    baselines: tuple[str, ...] = baselines_mod.BASELINES
    """Baselines run on the embedded engine."""
    fixed_cost_repeats: int = 5
    """Measured pushes per fixed-cost cell (0: skip the fixed cost)."""
    memory_methods: tuple[str, ...] = memory_mod.METHODS
    """Merged-LoRA memory methods measured on "dense" when "lora-merged" is among the modes
    (empty: skip)."""
    vllm_bucket_sizes: tuple[int, ...] = (64 * MiB,)
    """Bucket sizes vLLM runs."""
    out_dir: Path = Path("runs/bench")
    """Models, disk versions, the chart and the JSON go here."""
    quick: bool = False
    """Recorded in the report: a --quick run."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        return d


@dataclass
class BenchResult:
    """Everything one run measured (raw; `report` derives the judgements)."""

    config: BenchConfig
    machine: dict[str, Any]
    scenarios: list[Scenario] = field(default_factory=list)
    limits: dict[tuple[str, int], dict[str, limits_mod.Limit]] = field(default_factory=dict)
    """(scenario, bucket_bytes) -> limit name -> Limit."""
    cells: list[CellResult] = field(default_factory=list)
    fixed_cost: list[CellResult] = field(default_factory=list)
    """Pushes of the fixed-cost model, per engine, mode and transport."""
    baselines: dict[str, list[baselines_mod.BaselineResult]] = field(default_factory=dict)
    """scenario -> baseline results (embedded engine)."""
    memory: list[memory_mod.MemoryResult] = field(default_factory=list)
    engine_start_seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def describe_machine() -> dict[str, Any]:
    """CPU, memory, software and load, to print next to every figure."""
    import torch

    cpu_model = ""
    mem_total = 0
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
        with open("/proc/meminfo") as f:
            mem_total = int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) * 1024
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(), "cpu_model": cpu_model, "memory_bytes": mem_total,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0],
        "platform": platform.platform(), "load_average_start": list(os.getloadavg()),
    }


def run_sync_suite(config: BenchConfig, *, progress: Progress = lambda _: None,
                   on_cell: Callable[[CellResult], None] | None = None) -> BenchResult:
    """Run every part of the suite; failures of single cells are recorded, not raised."""
    started = time.perf_counter()
    result = BenchResult(config=config, machine=describe_machine())
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    for name in config.scenarios:
        scenario = make_scenario(name, config.model_bytes)
        result.scenarios.append(scenario)
        progress(f"scenario {scenario.describe()}")
        _run_scenario(scenario, config, result, progress, on_cell)
    if config.fixed_cost_repeats > 0:
        _run_fixed_cost(config, result, progress, on_cell)
    if config.memory_methods and "dense" in config.scenarios and "lora-merged" in config.modes:
        progress("trainer memory: merged LoRA layer by layer vs whole model")
        dense = next(s for s in result.scenarios if s.name == "dense")
        result.memory = memory_mod.measure_all(asdict(dense.model), config.memory_methods)
    result.machine["load_average_end"] = list(os.getloadavg())
    result.seconds = time.perf_counter() - started
    return result


def _run_scenario(scenario: Scenario, config: BenchConfig, result: BenchResult, progress: Progress,
                  on_cell: Callable[[CellResult], None] | None) -> None:
    from weightsync_tools.bench.scenarios import trainer_model

    out = config.out_dir
    engine_scenario = replace(scenario, model=replace(scenario.model, dtype=config.engine_dtype))
    model_dir = engine_model_dir(engine_scenario, out / "models")  # the same weights, in the engine's dtype
    models = _trainer_models(scenario, config.modes, trainer_model(scenario))
    for size in config.bucket_sizes:
        progress(f"limits for {scenario.num_bytes / MiB:.0f} MiB in {size // MiB} MiB chunks")
        result.limits[(scenario.name, size)] = limits_mod.measure_limits(
            scenario.num_bytes, size, directory=out, repeats=config.limit_repeats)
    for kind in config.engines:
        if kind == "vllm" and scenario.name != "dense":
            continue
        sizes = config.vllm_bucket_sizes if kind == "vllm" else config.bucket_sizes
        versions = out / "versions" / f"{scenario.name}-{kind}"
        shutil.rmtree(versions, ignore_errors=True)
        progress(f"starting the {kind} engine")
        try:
            with start_engine(kind, model_dir, disk_root=out) as engine:
                result.engine_start_seconds[f"{scenario.name}/{kind}"] = engine.start_seconds
                cells = engine_cells(scenario.name, engine, modes=_cell_modes(scenario, config.modes),
                                     transports=config.transports, bucket_sizes=sizes)
                result.cells.extend(run_engine_cells(cells, engine, models, repeats=config.repeats,
                                                     versions_dir=versions, on_cell=on_cell))
                if kind == "embedded" and config.baselines:
                    progress(f"baselines on {scenario.name}: {', '.join(config.baselines)}")
                    result.baselines[scenario.name] = baselines_mod.run_baselines(
                        engine.url, _in_engine_dtype(models["full"], config.engine_dtype),
                        next_version=engine.next_version, directory=out / "checkpoint", names=config.baselines)
        except (RuntimeError, OSError) as e:
            result.notes.append(f"{scenario.name}/{kind}: engine failed: {type(e).__name__}: {e}"[:500])
        finally:
            shutil.rmtree(versions, ignore_errors=True)


def _run_fixed_cost(config: BenchConfig, result: BenchResult, progress: Progress,
                    on_cell: Callable[[CellResult], None] | None) -> None:
    for kind in config.engines:
        progress(f"fixed cost of a push ({fixed_cost_mod.describe()}): starting the {kind} engine")
        try:
            result.fixed_cost.extend(fixed_cost_mod.run_fixed_cost(
                kind, root=config.out_dir, modes=config.modes, transports=config.transports,
                bucket_bytes=config.bucket_sizes[0], repeats=config.fixed_cost_repeats, on_cell=on_cell))
        except (RuntimeError, OSError) as e:
            result.notes.append(f"fixed cost/{kind}: engine failed: {type(e).__name__}: {e}"[:500])


def _cell_modes(scenario: Scenario, modes: tuple[str, ...]) -> list[str]:
    """The modes a scenario runs: all asked for on "dense", "full" only elsewhere."""
    return list(modes) if scenario.name == "dense" else [m for m in modes if m == "full"]


def _in_engine_dtype(model: Any, engine_dtype: str) -> Any:
    """The baselines send tensors as they are: give them a copy cast to the engine's dtype
    once, up front (outside their timings; a framework casts on every push)."""
    import copy

    import torch

    dtype = getattr(torch, engine_dtype)
    return model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)


def _trainer_models(scenario: Scenario, modes: tuple[str, ...], model: Any) -> dict[str, Any]:
    """mode -> the model a push of that mode reads: the plain model for "full" (and
    the baselines), one LoRA-wrapped copy for the LoRA modes."""
    import copy

    from weightsync_tools.bench.scenarios import with_lora

    out: dict[str, Any] = {"full": model}
    lora_modes = [m for m in _cell_modes(scenario, modes) if m != "full"]
    if lora_modes:
        peft_model = with_lora(copy.deepcopy(model))
        out.update({mode: peft_model for mode in lora_modes})
    return out
