"""What a streamed push costs a real `weightsync serve` beyond its model, over http and shm: at
most the bucket in hand (issue 51: two buckets), and nothing once it commits.

Each transport gets a fresh server and two streamed full pushes of a 48 MiB float32 model in
8 MiB buckets (`weightsync bench --suite engine-memory`'s own measurement,
`weightsync_tools.bench.engine_memory.measure_engine`); the second push is held to its
bound by the engine's own figures (its ack: the resident high-water mark from begin to
commit, read by the kernel, so no peak is missed) and by the summed Pss sampled from outside.
The bound is two buckets plus a 6 MiB margin for the interpreter's own allocations; what the
engine held before this fix (the http body, its pieces and a copy; a copy of every shm slot
on heap glibc keeps) was three to five buckets."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightsync_tools.bench.engine_memory import measure_engine
from weightsync_tools.bench.scenarios import engine_model_dir, make_scenario, trainer_model

MiB = 1 << 20
BUCKET_BYTES = 8 * MiB
BOUND_BYTES = 2 * BUCKET_BYTES + 6 * MiB
KEPT_BYTES = 6 * MiB


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path, int]:
    scenario = make_scenario("dense", 48 * MiB)
    root = tmp_path_factory.mktemp("streamed-memory")
    return trainer_model(scenario), engine_model_dir(scenario, root / "models"), scenario.num_bytes


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_a_streamed_push_holds_at_most_two_buckets_and_keeps_nothing(
        transport: str, model: tuple[object, Path, int], tmp_path: Path) -> None:
    trainer, model_dir, model_bytes = model
    cell = measure_engine("embedded", transport, model=trainer, model_dir=model_dir, model_bytes=model_bytes,
                          bucket_bytes=BUCKET_BYTES, root=tmp_path, commit="streamed")
    assert cell.error is None, cell.error
    assert model_bytes > 5 * BUCKET_BYTES  # the model is several buckets: a whole copy would show
    figures = cell.to_dict()
    assert cell.ack_peak_extra_bytes is not None and cell.ack_kept_bytes is not None, figures
    assert cell.ack_peak_extra_bytes <= BOUND_BYTES, figures
    assert cell.ack_kept_bytes <= KEPT_BYTES, figures
    assert cell.pss_peak_extra_bytes is not None and cell.pss_kept_bytes is not None, figures
    assert cell.pss_peak_extra_bytes <= BOUND_BYTES, figures
    assert cell.pss_kept_bytes <= KEPT_BYTES, figures
