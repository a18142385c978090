"""The session's one float32 `vllm serve` (a plugin module, loaded by tests/conftest.py's
`pytest_plugins`), for the contract suite and the server-form integration tests alike.

A vLLM start costs 25-40 s here (three processes, each importing vLLM), so every
test that talks to a float32 `vllm serve` shares this one, started when a test
first asks for it with everything they use: weightsync's worker extension, LoRA,
prefix caching, the FreezingScheduler that holds requests where a test asks
(`vllm_freezing_scheduler.py`, this directory on the server's PYTHONPATH) and
weightsync's weight-transfer backend (found through this checkout's
`vllm.general_plugins` entry point). Every test reads the served version and pushes
a newer one of the tiny model's shapes (the contract's trainers come from
`tiny_model_dir`, the integration tests' from `vllm_model_dir`: same config and
tokenizer), so the order of tests does not matter.

Not a conftest.py: the suite imports every conftest.py as the module `conftest`, and
tests/distributed's spawned ranks find their entry point there by that name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import vllm_support
from weightsync.engines.vllm_launch import VLLMServer, launch_vllm_server
from widened_model import make_widened_tiny_model

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared server's checkpoint: the tiny float32 Qwen2 with widened weights."""
    return make_widened_tiny_model(tmp_path_factory.mktemp("vllm-serve") / "tiny-vllm")


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The session's one float32 `vllm serve`."""
    vllm_support.require_vllm()
    args = [*vllm_support.server_args(), "--enable-prefix-caching",
            "--scheduler-cls", "vllm_freezing_scheduler.FreezingScheduler",
            "--weight-transfer-config", json.dumps({"backend": "weightsync"})]
    with vllm_support.plugin_installed(tmp_path_factory.mktemp("vllm-plugin")):
        pythonpath = os.pathsep.join([str(HERE), os.environ["PYTHONPATH"]])
    with launch_vllm_server(vllm_model_dir, args=args, env={"PYTHONPATH": pythonpath}) as running:
        print(f"\nvLLM server start (the session's float32 vllm serve): {running.start_seconds:.1f}s")
        yield running
