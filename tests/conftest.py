"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightsync.tiny import TinyModelConfig, make_tiny_model

pytest_plugins = ["vllm_shared_server"]  # fixtures: vllm_server, vllm_model_dir (the session's float32 vllm serve)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """tests/unit first, then the rest in their usual order: the pure tests fail fast, and
    the engines the later tests share come up in the background meanwhile
    (tests/vllm_shared_server.py)."""
    unit = Path(__file__).parent / "unit"
    items.sort(key=lambda item: not item.path.is_relative_to(unit))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 Qwen2 model directory with tokenizer (untied embeddings)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), TinyModelConfig())
