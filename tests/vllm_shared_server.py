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
`tiny_model_dir`, the fault tests' from `fault_model`, the integration tests' from
`vllm_model_dir`: same config and tokenizer), so the order of tests does not matter.
The fault suite stops it (SIGSTOP) and, last, kills it mid-push: `restart()` starts it
again with the same settings, serving its checkpoint as version 0, for the tests after.

Not a conftest.py: the suite imports every conftest.py as the module `conftest`, and
tests/distributed's spawned ranks find their entry point there by that name.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
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


class SessionVLLM:
    """The session's `vllm serve`: a `VLLMServer` (`url`, `process`, `log_path`,
    `start_seconds`, `log_tail`) that `restart` replaces after a test killed it."""

    def __init__(self, model_dir: Path, args: Sequence[str], env: Mapping[str, str]) -> None:
        self._launch = lambda: launch_vllm_server(model_dir, args=args, env=env)
        self._stack = contextlib.ExitStack()
        self._server = self._start()

    def _start(self) -> VLLMServer:
        server = self._stack.enter_context(self._launch())
        print(f"\nvLLM server start (the session's float32 vllm serve): {server.start_seconds:.1f}s")
        return server

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self._server.process

    @property
    def log_path(self) -> Path:
        return self._server.log_path

    @property
    def start_seconds(self) -> float:
        return self._server.start_seconds

    def log_tail(self, num_lines: int = 40) -> str:
        return self._server.log_tail(num_lines)

    def restart(self) -> SessionVLLM:
        """Stop what is left of the server and start it again (same model, settings and
        environment; a new port): it serves its checkpoint as version 0."""
        self._stack.close()
        self._server = self._start()
        return self

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SessionVLLM]:
    """The session's one float32 `vllm serve`."""
    vllm_support.require_vllm()
    args = [*vllm_support.server_args(), "--enable-prefix-caching",
            "--scheduler-cls", "vllm_freezing_scheduler.FreezingScheduler",
            "--weight-transfer-config", json.dumps({"backend": "weightsync"})]
    with vllm_support.plugin_installed(tmp_path_factory.mktemp("vllm-plugin")):
        pythonpath = os.pathsep.join([str(HERE), os.environ["PYTHONPATH"]])
    server = SessionVLLM(vllm_model_dir, args, {"PYTHONPATH": pythonpath})
    try:
        yield server
    finally:
        server.close()
