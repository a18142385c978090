"""One `vllm serve` for the server-form vLLM tests (a plugin module: `pytest_plugins`).

A vLLM start costs 20-30 s here (three processes, each importing vLLM), so the
server-form modules (`test_vllm_prefix_cache.py`, `test_vllm_server.py`,
`test_vllm_transfer_server.py`) share one server started with everything they use:
weightsync's worker extension, LoRA, prefix caching, the FreezingScheduler that
holds requests where a test asks (`vllm_freezing_scheduler.py`, this directory on
the server's PYTHONPATH) and weightsync's weight-transfer backend (found through
this checkout's `vllm.general_plugins` entry point). Each test reads the served
version and pushes a newer one, so the order of tests does not matter.

Not a conftest.py: the suite imports every conftest.py as the module `conftest`, and
tests/distributed's spawned ranks find their entry point there by that name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import vllm_fixtures as vf

import vllm_support
from weightsync.engines.vllm_launch import VLLMServer, launch_vllm_server

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server-form vLLM tests' model: the tiny float32 Qwen2 with widened weights."""
    return vf.make_model_dir(tmp_path_factory.mktemp("vllm-serve"))


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The one `vllm serve` of the server-form vLLM tests."""
    vf.require_vllm()
    args = [*vf.server_args(), "--enable-prefix-caching",
            "--scheduler-cls", "vllm_freezing_scheduler.FreezingScheduler",
            "--weight-transfer-config", json.dumps({"backend": "weightsync"})]
    with vllm_support.plugin_installed(tmp_path_factory.mktemp("vllm-plugin")):
        pythonpath = os.pathsep.join([str(HERE), os.environ["PYTHONPATH"]])
    with launch_vllm_server(vllm_model_dir, args=args, env={"PYTHONPATH": pythonpath}) as running:
        print(f"\nvLLM server start (server-form tests): {running.start_seconds:.1f}s")
        yield running
