"""The engine-memory suite's parts that need no engine: the engine's processes found from its
first one, Pss summed over them, and the table in model copies. The suite itself starts
engines: `weightsync bench --suite engine-memory` (docs/bench/engine-memory.md)."""

from __future__ import annotations

import os
import subprocess
import sys

from weightsync_tools.bench.engine_memory import (
    EngineMemory,
    EngineMemoryResult,
    engine_processes,
    format_table,
    total_pss,
)

MiB = 1 << 20


def test_an_engines_processes_are_its_first_one_and_every_descendant() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        found = engine_processes(os.getpid())
        assert child.pid in found and os.getpid() in found and os.getppid() not in found
        assert (total_pss([os.getpid(), child.pid]) or 0) > (total_pss([child.pid]) or 0) > 0
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    assert total_pss([child.pid]) is None, "a process gone has no Pss to read"


def test_the_table_gives_model_copies_and_mib_and_names_a_failed_cell() -> None:
    model = 200 * MiB
    ok = EngineMemory(engine="embedded", transport="shm", model_bytes=model, bucket_bytes=32 * MiB,
                      ack_peak_extra_bytes=75 * MiB, ack_kept_bytes=100 * MiB, num_processes=1,
                      pss_before_bytes=900 * MiB, pss_peak_extra_bytes=50 * MiB, pss_kept_bytes=-10 * MiB)
    failed = EngineMemory(engine="vllm-tp2", transport="shm", model_bytes=model, bucket_bytes=32 * MiB,
                          error="RuntimeError: no second core")
    table = format_table(EngineMemoryResult(scenario={"num_bytes": model, "num_tensors": 9}, machine={},
                                            cells=[ok, failed]))
    row = next(line for line in table.splitlines() if line.startswith("embedded"))
    assert row.split()[2:11] == ["staged", "+0.38", "(75)", "+0.50", "(100)", "+0.25", "(50)", "-0.05", "(-10)"]
    assert "vllm-tp2   shm       staged   FAILED: RuntimeError: no second core" in table
    assert ok.copies(None) is None and ok.to_dict()["ack_kept_bytes"] == 100 * MiB
