"""Fixtures for the contract suite: real `weightsync serve` engines and a trainer.

Two engine replicas are started once per session; every test pushes strictly
newer versions (`contract_helpers.next_version`), so tests share them in any order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from weightsync.server.launch import ServerProcess, launch_server


@pytest.fixture(scope="session")
def disk_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("disk-root")


@pytest.fixture(scope="session")
def engines(tiny_model_dir: Path, disk_root: Path) -> Iterator[list[ServerProcess]]:
    servers = [launch_server(tiny_model_dir, args=["--disk-root", str(disk_root)]) for _ in range(2)]
    try:
        yield servers
    finally:
        for s in servers:
            s.close()
