"""Fixtures for the fault-injection suite (a pytest plugin, no tests here).

tests/conftest.py loads it (`pytest_plugins`). Not a conftest.py:
tests/distributed pickles functions of ITS conftest by module name for spawned
children, which breaks when another directory's conftest.py is imported first.

One `Rig` (a real `weightsync serve` with an admin key, small --session-timeout
and --group-timeout) is shared by the whole suite: no fault leaves it broken,
and the engine-kill tests restart it on the same port. Tests that must change
what the server accepts (fuzzing pushes versions anywhere) get their own
`keyed_server`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serve_check import checked
from weightsync.server.launch import ServerProcess, launch_server
from weightsync_tools.faults import ADMIN_KEY, Rig, make_fault_model


@pytest.fixture(scope="session")
def fault_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose greedy answers identify the weights that computed them."""
    return make_fault_model(tmp_path_factory.mktemp("fault-model") / "tiny")


@pytest.fixture(scope="session")
def rig(fault_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with Rig(fault_model, tmp_path_factory.mktemp("fault-root")) as rig:
        yield rig
        log = rig.server.log_text() if rig.server is not None else ""
    assert "Traceback" not in log, f"the engine logged an unhandled error:\n{log[-4000:]}"


@pytest.fixture(scope="session")
def keyed_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keyed-root")


@pytest.fixture(scope="session")
def keyed_server(fault_model: Path, keyed_root: Path) -> Iterator[ServerProcess]:
    """A server of its own (admin key, LoRA on, 1 s group timeout) for fuzzing and security."""
    yield from checked(launch_server(fault_model, args=["--admin-api-key", ADMIN_KEY, "--enable-lora", "--num-threads",
                                                        "1", "--disk-root", str(keyed_root), "--group-timeout", "1"]))


@pytest.fixture(scope="module")
def admin(keyed_server: ServerProcess) -> Iterator[httpx.Client]:
    """A client of `keyed_server` that sends the admin key."""
    with httpx.Client(base_url=keyed_server.url, timeout=60,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as client:
        yield client
