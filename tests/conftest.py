"""Fixtures shared by every test directory.

Helper modules and fixture plugins live in tests/support/ (on sys.path through
pyproject.toml's `[tool.pytest.ini_options] pythonpath`); the plugins below are the
fixtures more than one test module uses. pytest imports every conftest.py under the one
module name `conftest`, so nothing a spawned process must find by name may live in one
(tests/distributed's ranks run `dist_util.spawned_rank`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weightsync.tiny import TinyModelConfig, make_tiny_model

pytest_plugins = [
    "vllm_shared_server",  # vllm_server, vllm_bf16_server, vllm_model_dir, module_vllm_server (vllm serves)
    "server_fixtures",  # server, client, tiny_model, model_root, kit, one_torch_thread (weightsync serve)
    "fault_fixtures",  # fault_model, rig, keyed_root, keyed_server, admin (the fault suite's servers)
]


VLLM_FIXTURES = frozenset({"vllm_server", "vllm_bf16_server", "module_vllm_server", "engine_pool"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """tests/unit first; then the integration and framework modules that start no vLLM and
    bound no time; then the rest in their usual order. The pure tests fail fast, and the
    vLLM servers the later tests share start in the background meanwhile
    (tests/support/vllm_shared_server.py), mostly while the modules of the second group wait
    on their own engines (a `weightsync serve` or Ray works while the test waits: the two
    cores were 35-48% idle there when they ran after the vLLM tests). In scripts/suite.py's
    second session (no unit tests there) the multi-host tests come first: they wait most, so
    their waits fill the cores beside the first session's CPU-bound start instead of ending
    the run alone. A module moves whole (its module fixtures start once)."""
    here = Path(__file__).parent
    early = (here / "integration", here / "frameworks")
    uses_vllm = {item.path for item in items if item.get_closest_marker("vllm") is not None
                 or not VLLM_FIXTURES.isdisjoint(item.fixturenames)}

    second = os.environ.get("WEIGHTSYNC_SUITE_PART") == "second"  # scripts/suite.py's second session

    def group(item: pytest.Item) -> int:
        if item.path.is_relative_to(here / "unit"):
            return 0
        if second and item.path.is_relative_to(here / "multihost"):
            return 0  # they wait most: beside the first session's CPU-bound start, not alone at the end
        if any(item.path.is_relative_to(d) for d in early) and item.path not in uses_vllm:
            return 1
        return 2

    items.sort(key=group)  # stable: each group keeps the usual order
    if second:
        for item in items:
            if item.path in uses_vllm:
                item.add_marker(pytest.mark.usefixtures("_no_vllm_in_the_second_session"))


@pytest.fixture
def _no_vllm_in_the_second_session(request: pytest.FixtureRequest) -> None:
    pytest.fail(f"{request.node.nodeid} uses a vLLM, but scripts/suite.py runs it in the second session, which "
                "starts none: take its path out of scripts/suite.py's SECOND", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 Qwen2 model directory with tokenizer (untied embeddings)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), TinyModelConfig())
