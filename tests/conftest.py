"""Fixtures shared by every test directory.

Helper modules and fixture plugins live in tests/support/ (on sys.path through
pyproject.toml's `[tool.pytest.ini_options] pythonpath`); the plugins below are the
fixtures more than one test module uses. pytest imports every conftest.py under the one
module name `conftest`, so nothing a spawned process must find by name may live in one
(tests/distributed's ranks run `dist_util.spawned_rank`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from weightsync.tiny import TinyModelConfig, make_tiny_model

pytest_plugins = [
    "vllm_shared_server",  # vllm_server, vllm_bf16_server, vllm_model_dir, module_vllm_server (vllm serves)
    "server_fixtures",  # server, client, tiny_model, model_root, kit, one_torch_thread (weightsync serve)
    "fault_fixtures",  # fault_model, rig, keyed_root, keyed_server, admin (the fault suite's servers)
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """tests/unit first, then the rest in their usual order: the pure tests fail fast, and
    the engines the later tests share come up in the background meanwhile
    (tests/support/vllm_shared_server.py)."""
    unit = Path(__file__).parent / "unit"
    items.sort(key=lambda item: not item.path.is_relative_to(unit))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 Qwen2 model directory with tokenizer (untied embeddings)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), TinyModelConfig())
