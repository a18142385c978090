"""The fixed cost of a push: what a push costs when it moves almost nothing.

An engine is started on a one-layer Qwen2 of 194 KB (`SCENARIO`), and
the trainer pushes it whole ("full", 14 tensors) and as a rank-1 adapter on
the layer's q_proj ("lora", 2 tensors, 512 bytes) over every transport the
engine takes. The figures per cell: the fastest and the median push, and the
HTTP requests each push made (round trips to the engine: begin, buckets,
pause, commit, resume, ...). A big push hides this cost; it is most of a
LoRA push of a few hundred KB, and a slow round trip (for example a delayed
ACK, issue 12) shows here first.

Boundaries: picks the model and the cells; running them is `bench.matrix`,
starting engines is `bench.engines`, formatting is `bench.report`.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from weightsync.tiny import TinyModelConfig
from weightsync_tools.bench.engines import start_engine
from weightsync_tools.bench.matrix import CellResult, engine_cells, run_engine_cells
from weightsync_tools.bench.scenarios import Scenario, engine_model_dir, trainer_model, with_lora

SCENARIO = Scenario(name="fixed-cost", model=TinyModelConfig(
    num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=64, vocab_size=320, tie_word_embeddings=True))
"""One layer, hidden 64, tied embeddings: float32, 194 KB in 14 tensors."""
MODES = ("full", "lora")
LORA_RANK = 1
LORA_TARGETS = ["q_proj"]


def describe() -> str:
    """What the fixed cost pushes, in words."""
    cfg = SCENARIO.model
    return (f"a Qwen2 of {cfg.num_layers} layer x hidden {cfg.hidden_size}, {SCENARIO.num_tensors} tensors, "
            f"{SCENARIO.num_bytes / 1024:.1f} KiB, pushed whole; lora: a rank-{LORA_RANK} adapter on "
            f"{', '.join(LORA_TARGETS)}")


def trainer_models(modes: Sequence[str]) -> dict[str, Any]:
    """mode -> the trainer's model: the engine's own weights for "full", plus a
    rank-1 adapter on q_proj for "lora"."""
    model = trainer_model(SCENARIO)
    models: dict[str, Any] = {"full": model}
    if "lora" in modes:
        models["lora"] = with_lora(copy.deepcopy(model), rank=LORA_RANK, target_modules=LORA_TARGETS)
    return models


def run_fixed_cost(kind: str, *, root: Path, modes: Sequence[str], transports: Sequence[str], bucket_bytes: int,
                   repeats: int, on_cell: Callable[[CellResult], None] | None = None) -> list[CellResult]:
    """Start engine `kind` on the fixed-cost model and push it in every mode of
    `modes` that is in MODES, over every transport it takes."""
    modes = [m for m in modes if m in MODES]
    if not modes:
        return []
    model_dir = engine_model_dir(SCENARIO, root / "models")
    models = trainer_models(modes)
    versions = root / "versions" / f"{SCENARIO.name}-{kind}"
    shutil.rmtree(versions, ignore_errors=True)
    try:
        with start_engine(kind, model_dir, disk_root=root) as engine:
            cells = engine_cells(SCENARIO.name, engine, modes=modes, transports=transports,
                                 bucket_sizes=[bucket_bytes])
            return run_engine_cells(cells, engine, models, repeats=repeats, versions_dir=versions, on_cell=on_cell)
    finally:
        shutil.rmtree(versions, ignore_errors=True)
