"""Fixtures for the contract suite: the session's real engines of every kind
(`engine_matrix.EnginePool`) and a directory the disk transport writes to.

Each kind is started once per session, when its first test asks; every test pushes
strictly newer versions (`contract_helpers.next_version`), so tests share engines in
any order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_matrix import EnginePool
from weightsync.engines.vllm.launch import VLLMServer
from weightsync.server.launch import ServerProcess


@pytest.fixture(scope="session")
def disk_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("disk-root")


@pytest.fixture(scope="session")
def engine_pool(tiny_model_dir: Path, disk_root: Path, tmp_path_factory: pytest.TempPathFactory,
                request: pytest.FixtureRequest) -> Iterator[EnginePool]:
    """Engines of a kind: `engine_pool.clients("vllm")`; stopped when the session ends.
    The vLLMs are the session's shared float32 and bfloat16 `vllm serve`s
    (tests/support/vllm_shared_server.py)."""
    fixtures = {"float32": "vllm_server", "bfloat16": "vllm_bf16_server"}

    def shared_vllm(dtype: str) -> VLLMServer:
        if dtype not in fixtures:
            raise ValueError(f"no session vLLM serves {dtype}: tests/support/vllm_shared_server.py starts "
                             f"{sorted(fixtures)}")
        return request.getfixturevalue(fixtures[dtype])

    pool = EnginePool(tiny_model_dir, tmp_path_factory.mktemp("dtypes"), disk_root, shared_vllm=shared_vllm)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def engines(engine_pool: EnginePool) -> list[ServerProcess]:
    """The two embedded float32 engines' processes."""
    return engine_pool.embedded_servers()
