"""The session's one float32 `vllm serve` (a plugin module, loaded by tests/conftest.py's
`pytest_plugins`), for the contract suite and the server-form integration tests alike.

A vLLM start costs 25-40 s here (three processes, each importing vLLM), so every
test that talks to a float32 `vllm serve` shares this one, started with everything
they use: weightsync's worker extension, LoRA, prefix caching, the FreezingScheduler
that holds requests where a test asks (`vllm_freezing_scheduler.py`, this directory
on the server's PYTHONPATH) and weightsync's weight-transfer backend (found through
this checkout's `vllm.general_plugins` entry point). Every test reads the served
version and pushes a newer one of the tiny model's shapes (the contract's trainers
come from `tiny_model_dir`, the fault tests' from `fault_model`, the integration
tests' from `vllm_model_dir`: same config and tokenizer), so the order of tests does
not matter. The fault suite stops it (SIGSTOP) and, last, kills it mid-push (marked
`kills_shared_vllm`): `restart()` puts a new server with the same settings in its
place, serving its checkpoint as version 0, for the tests after.

Started in the background: once the session's tests are collected, if any of them
uses the server (`uses_shared_vllm`), it starts in a thread while other tests run
(a vLLM start keeps about one core busy; the unit tests run first, see
tests/conftest.py), and so does the replacement a `kills_shared_vllm` test will
need. A test that asks before it is ready waits for it.

Not a conftest.py: the suite imports every conftest.py as the module `conftest`, and
tests/distributed's spawned ranks find their entry point there by that name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import vllm_support
from weightsync.engines.vllm.launch import VLLMServer, launch_vllm_server
from weightsync.tiny import TinyModelConfig, make_tiny_model
from widened_model import make_widened_tiny_model

HERE = Path(__file__).parent


def uses_shared_vllm(item: pytest.Item) -> bool:
    """Does this test push into the session's float32 `vllm serve`: through the
    `vllm_server` fixture, or as a vLLM case of the contract's engine pool?"""
    return "vllm_server" in item.fixturenames or (
        item.get_closest_marker("vllm") is not None and "engine_pool" in item.fixturenames)


@dataclass(frozen=True)
class ModuleVLLM:
    """A `vllm serve` a test module needs for itself (another model): the module declares
    it as `VLLM_SERVE = ModuleVLLM(...)` and takes it from the `module_vllm_server` fixture;
    it is started in the background once the session's tests are collected."""

    name: str
    """Names it in the session (one server per name)."""
    make_model: Callable[[Path], Path]
    """Writes the checkpoint under the given directory and returns its path."""
    args: tuple[str, ...]
    """`vllm serve` flags (weightsync's worker extension is always on; the KV cache is
    `vllm_support.KV_CACHE_BYTES` unless they say otherwise)."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables the server gets beyond this process's."""
    pythonpath: tuple[str, ...] = ()
    """Directories put first on the server's PYTHONPATH (e.g. a test's own worker extension)."""
    plugin: bool = False
    """Whether vLLM finds weightsync's plugin (the "weightsync" weight-transfer backend) as an
    installed package would (`vllm_support.plugin_installed`)."""


def with_kv_bytes(args: list[str] | tuple[str, ...]) -> list[str]:
    """`args` with `--kv-cache-memory-bytes vllm_support.KV_CACHE_BYTES` unless they size the KV
    cache themselves (in bytes: a fraction would be of the NUMA node, see `KV_CACHE_BYTES`)."""
    given = any(a.startswith("--kv-cache-memory-bytes") for a in args)
    return [*args, *(() if given else ("--kv-cache-memory-bytes", str(vllm_support.KV_CACHE_BYTES)))]


def module_vllm(item: pytest.Item) -> ModuleVLLM | None:
    """The `vllm serve` this test's module declares, if it takes one."""
    spec = getattr(item.module, "VLLM_SERVE", None) if isinstance(item, pytest.Function) else None
    return spec if "module_vllm_server" in item.fixturenames else None


def uses_bf16_vllm(item: pytest.Item) -> bool:
    """Does this test push into the session's bfloat16 `vllm serve` (a vLLM case of a
    module marked `engine_dtype("bfloat16")`)?"""
    return item.get_closest_marker("vllm") is not None and any(
        mark.args == ("bfloat16",) for mark in item.iter_markers("engine_dtype"))


class Launch:
    """One `launch_vllm_server` begun in a background thread: `server()` waits until it
    answers (or raises what stopped it); `close()` stops it."""

    def __init__(self, launch: Callable[[], AbstractContextManager[VLLMServer]], after: Launch | None = None) -> None:
        self._stack = contextlib.ExitStack()
        self._server: VLLMServer | None = None
        self._error: BaseException | None = None
        self._after = after
        self._thread = threading.Thread(target=self._run, args=(launch,), daemon=True, name="vllm-launch")
        self._thread.start()

    def _run(self, launch: Callable[[], AbstractContextManager[VLLMServer]]) -> None:
        if self._after is not None:
            self._after._thread.join()  # one start at a time: the first user waits for the first one
        try:
            self._server = self._stack.enter_context(launch())
        except BaseException as e:
            self._error = e

    def server(self) -> VLLMServer:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._server is not None
        return self._server

    def close(self) -> None:
        self._thread.join()
        self._stack.close()


class SessionVLLM:
    """The session's `vllm serve`: a `VLLMServer` (`url`, `process`, `log_path`,
    `start_seconds`, `log_tail`) that `restart` replaces after a test killed it."""

    def __init__(self, model_dir: Path, pythonpath: str) -> None:
        self.model_dir = model_dir
        args = with_kv_bytes([*vllm_support.server_args(), "--enable-prefix-caching",
                                 "--scheduler-cls", "vllm_freezing_scheduler.FreezingScheduler",
                                 "--weight-transfer-config", json.dumps({"backend": "weightsync"})])
        env = {"PYTHONPATH": pythonpath}
        self._launch = lambda: launch_vllm_server(model_dir, args=args, env=env)
        self._current = Launch(self._launch)
        self._spare: Launch | None = None
        """The server `restart` puts in place, when started early (`start_spare`)."""

    def start_spare(self, after: Launch) -> Launch:
        """Start now, in the background after `after`, the server `restart` will put in place."""
        self._spare = Launch(self._launch, after=after)
        return self._spare

    @property
    def _server(self) -> VLLMServer:
        return self._current.server()

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
        """Stop what is left of the server and put a new one with the same model, settings
        and environment in its place (the spare, or one started now; a new port): it serves
        its checkpoint as version 0."""
        self._current.close()
        self._current, self._spare = self._spare or Launch(self._launch), None
        print(f"\nvLLM server restart (the session's float32 vllm serve): its replacement took "
              f"{self.start_seconds:.1f}s to start")
        return self

    def close(self) -> None:
        for launch in (self._current, self._spare):
            if launch is not None:
                launch.close()


class SessionEngines:
    """The session's vLLM servers, each started once, in the background, one after another."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="weightsync-vllm-serve-"))
        self.float32: SessionVLLM | None = None
        self.bfloat16: Launch | None = None
        self.modules: dict[str, tuple[Path, Launch]] = {}
        """Servers test modules declared (`ModuleVLLM`), by name: checkpoint and launch."""
        self._last: Launch | None = None
        """The start the next one waits for (two vLLM starts at once only slow each other)."""

    def start_float32(self) -> SessionVLLM:
        if self.float32 is None:
            with vllm_support.plugin_installed(self.root / "plugin"):
                pythonpath = os.pathsep.join([str(HERE), os.environ["PYTHONPATH"]])
            self.float32 = SessionVLLM(make_widened_tiny_model(self.root / "tiny-vllm"), pythonpath)
            self._last = self.float32._current
        return self.float32

    def start_bfloat16(self) -> Launch:
        """The tiny Qwen2 (`make_tiny_model`'s defaults: the weights of the suite's
        `tiny_model_dir`) served in bfloat16, for the contract's vLLM cases."""
        if self.bfloat16 is None:
            model_dir = make_tiny_model(self.root / "tiny-qwen2", TinyModelConfig())
            args = with_kv_bytes(["--dtype", "bfloat16", "--max-model-len", "1024"])
            self.bfloat16 = self._last = Launch(lambda: launch_vllm_server(model_dir, args=args), after=self._last)
        return self.bfloat16

    def start_module(self, spec: ModuleVLLM) -> tuple[Path, Launch]:
        if spec.name not in self.modules:
            model_dir = spec.make_model(self.root / spec.name)
            args = with_kv_bytes(spec.args)
            env = dict(spec.env)
            if spec.pythonpath or spec.plugin:
                with vllm_support.plugin_installed(self.root / "plugin") if spec.plugin else contextlib.nullcontext():
                    env["PYTHONPATH"] = os.pathsep.join([*spec.pythonpath, os.environ.get("PYTHONPATH", "")])
            launch = Launch(lambda: launch_vllm_server(model_dir, args=args, env=env), after=self._last)
            self.modules[spec.name] = (model_dir, launch)
            self._last = launch
        return self.modules[spec.name]

    def start_spare(self) -> None:
        """Start the float32 server's replacement (for a `kills_shared_vllm` test)."""
        float32 = self.start_float32()
        assert self._last is not None
        self._last = float32.start_spare(after=self._last)

    def close(self) -> None:
        for launch in (self.float32, self.bfloat16, *(launch for _, launch in self.modules.values())):
            if launch is not None:
                launch.close()
        shutil.rmtree(self.root, ignore_errors=True)


_ENGINES = pytest.StashKey[SessionEngines]()


def _engines(config: pytest.Config) -> SessionEngines:
    if _ENGINES not in config.stash:
        config.stash[_ENGINES] = SessionEngines()
    return config.stash[_ENGINES]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the servers the collected tests will use, in the background (their checkpoints
    are written here, before the first test, with transformers' progress bars off)."""
    if session.config.option.collectonly or importlib.util.find_spec("vllm") is None:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        _start_used(session)
    finally:
        hf_logging.enable_progress_bar()


def _start_used(session: pytest.Session) -> None:
    users = [item for item in session.items if uses_shared_vllm(item)]
    if users:
        _engines(session.config).start_float32()
    if any(uses_bf16_vllm(item) for item in session.items):
        _engines(session.config).start_bfloat16()
    if any(item.get_closest_marker("kills_shared_vllm") for item in users):
        _engines(session.config).start_spare()
    for spec in {spec.name: spec for item in session.items if (spec := module_vllm(item)) is not None}.values():
        _engines(session.config).start_module(spec)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _ENGINES in config.stash:
        config.stash[_ENGINES].close()


@pytest.fixture(scope="session")
def vllm_server(request: pytest.FixtureRequest) -> SessionVLLM:
    """The session's one float32 `vllm serve` (stopped when the session ends)."""
    vllm_support.require_vllm()
    server = _engines(request.config).start_float32()
    print(f"\nvLLM server start (the session's float32 vllm serve): {server.start_seconds:.1f}s, "
          "begun in the background")
    return server


@pytest.fixture(scope="session")
def vllm_bf16_server(request: pytest.FixtureRequest) -> VLLMServer:
    """The session's bfloat16 `vllm serve` of the tiny model (stopped when the session ends)."""
    vllm_support.require_vllm()
    server = _engines(request.config).start_bfloat16().server()
    print(f"\nvLLM server start (the session's bfloat16 vllm serve): {server.start_seconds:.1f}s, "
          "begun in the background")
    return server


@pytest.fixture(scope="session")
def vllm_model_dir(vllm_server: SessionVLLM) -> Path:
    """The shared server's checkpoint: the tiny float32 Qwen2 with widened weights."""
    return vllm_server.model_dir


@pytest.fixture(scope="module")
def module_vllm_server(request: pytest.FixtureRequest) -> Iterator[tuple[Path, VLLMServer]]:
    """The `vllm serve` the test module declares as `VLLM_SERVE` (a `ModuleVLLM`): its
    checkpoint directory and the server, stopped when the module's tests are done (no
    other module uses it; its memory goes back before the next module's engines run)."""
    vllm_support.require_vllm()
    spec = request.module.VLLM_SERVE
    model_dir, launch = _engines(request.config).start_module(spec)
    server = launch.server()
    print(f"\nvLLM server start ({spec.name}): {server.start_seconds:.1f}s, begun in the background")
    yield model_dir, server
    launch.close()


@pytest.fixture(scope="module")
def module_model_dir(module_vllm_server: tuple[Path, VLLMServer]) -> Path:
    """The checkpoint directory of the module's `vllm serve` (`VLLM_SERVE`)."""
    return module_vllm_server[0]


@pytest.fixture(scope="module")
def module_engine(module_vllm_server: tuple[Path, VLLMServer]) -> Iterator[Any]:
    """A `VLLMEngine` client of the module's `vllm serve` (`VLLM_SERVE`), closed after the module."""
    from weightsync.engines.vllm.client import VLLMEngine

    with contextlib.closing(VLLMEngine(module_vllm_server[1].url)) as engine:
        yield engine
