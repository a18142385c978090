"""Where the suite's CPU goes: `pytest -p cpu_profile` writes, per test, the CPU seconds its
session's process tree spent while it ran (setup, call and teardown), to the file named by
`WEIGHTSYNC_CPU_PROFILE` (default `cpu-profile.tsv`; scripts/suite.py's two sessions each
add their part's name before the suffix).

The suite is CPU-bound on 2 cores when its two sessions run side by side, so a test's wall
time says little about its cost: it may wait while the other session works. This counts
pytest itself, the processes it reaped, and every live descendant (`weightsync serve`s,
`vllm serve`s, gloo ranks, Ray's workers when they are its children), so a server started
by a fixture is charged to the test that started it, and its work during a push to the
test that pushed.

    python scripts/suite.py -p cpu_profile     # cpu-profile-first.tsv and cpu-profile-second.tsv
    sort -rn cpu-profile-*.tsv | head -25       # CPU s, wall s, test
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest


def tree_cpu_s() -> float:
    """CPU seconds of this process, its reaped children and every live descendant."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:4])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # it ended meanwhile: its time moves to its parent once reaped
            total += sum(child.cpu_times()[:4])
    return total


def _path() -> Path:
    path = Path(os.environ.get("WEIGHTSYNC_CPU_PROFILE", "cpu-profile.tsv"))
    part = os.environ.get("WEIGHTSYNC_SUITE_PART")
    return path.with_name(f"{path.stem}-{part}{path.suffix}") if part else path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    cpu, wall = tree_cpu_s(), time.monotonic()
    yield
    line = f"{tree_cpu_s() - cpu:.2f}\t{time.monotonic() - wall:.2f}\t{item.nodeid}\n"
    with _path().open("a") as out:
        out.write(line)
