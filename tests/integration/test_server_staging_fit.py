"""A staged push that would not fit in the engine's memory, into a real `weightsync serve`: the
begin is refused before a byte moves (HTTP 413, the trainer's EngineError naming the bytes
needed and available and `commit="streamed"`), the engine keeps serving its version bit for
bit, and the same push streamed lands. The server's `--staging-bytes-limit` stands in for a
host short of memory; the estimate and the host's figures: tests/unit/test_update_session.py
and tests/unit/test_process_memory.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import weightsync as ws
from weightsync.errors import EngineError

# fixtures client, tiny_model, kit: tests/support/server_fixtures.py

LIMIT_BYTES = 64 << 10
"""Far less than the tiny model's 1.7 MB."""


@pytest.fixture(scope="module")
def server(tiny_model: Path, one_torch_thread: None, kit: SimpleNamespace) -> Iterator[Any]:
    yield from kit.start_server(tiny_model, "--staging-bytes-limit", str(LIMIT_BYTES))


def test_a_staged_push_too_big_to_stage_is_refused_naming_bytes_and_streamed_and_the_engine_serves_on(
        server: Any, client: Any, tiny_model: Path, kit: SimpleNamespace) -> None:
    engine = ws.SGLangEngine(server.url)
    version, served = client.version(), client.digests()
    trainer = kit.load_model(tiny_model, kit.perturbed(tiny_model, seed=5))
    with ws.WeightSync([engine], transport="http") as sync, pytest.raises(EngineError) as refused:
        sync.push(trainer, version=version + 1)
    e = refused.value
    assert e.status == 413 and e.engine == server.url, e
    needed = int(re.search(r"needs (\d+) bytes", str(e)).group(1))  # type: ignore[union-attr]
    assert needed > 1_000_000  # the whole model, staged beside the served one
    assert f"its staging limit is {LIMIT_BYTES}" in str(e) and 'set commit="streamed"' in str(e)
    assert client.version() == version and client.digests() == served
    assert client.info()["session"] is None
    assert client.generate([5, 17, 42])["output_ids"]
    with ws.WeightSync([engine], transport="http", commit="streamed") as sync:
        assert sync.push(trainer, version=version + 1).verified
    assert client.version() == version + 1 and client.digests() != served
