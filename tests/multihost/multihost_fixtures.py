"""Fixtures of the multi-host rig (a pytest plugin, loaded by the test module with
`pytest_plugins`; not a conftest.py, for the reason tests/support/fault_fixtures.py gives).

    net       a trainer host and two engine hosts on one switch (`weightsync_tools.netns.Network`)
    engines   a real `weightsync serve` on each engine host, bound to its address
    trainer   `trainer_main.py` on the trainer host, driven one JSON line at a time

All three are module-scoped: one rig per module. Where namespaces cannot be
made (not root, no iproute2) the tests skip saying why, or fail where
WEIGHTSYNC_REQUIRE_NETNS=1.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from weightsync.server.launch import ServerProcess, launch_server
from weightsync.tiny import make_tiny_model
from weightsync_tools.netns import NamespaceError, Network, remove_stale, unavailable

HOSTS = ("trainer", "engine0", "engine1")
ENGINE_HOSTS = HOSTS[1:]
GROUP_TIMEOUT_S = 5.0
ANSWER_TIMEOUT_S = 300.0
"""Turns a hung trainer into a failure; no answer takes near this long."""
_HERE = Path(__file__).resolve().parent


def _skip_or_fail(reason: str) -> None:
    message = f"multi-host rig: {reason} (network namespaces are needed for these tests)"
    if os.environ.get("WEIGHTSYNC_REQUIRE_NETNS") == "1":
        pytest.fail(f"WEIGHTSYNC_REQUIRE_NETNS=1 but {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def net() -> Iterator[Network]:
    reason = unavailable()
    if reason is not None:
        _skip_or_fail(reason)
    try:
        remove_stale()
        network = Network(HOSTS).__enter__()
    except (NamespaceError, OSError) as e:
        _skip_or_fail(f"cannot create network namespaces here: {e}")
    try:
        yield network
    finally:
        network.close()


class Engines:
    """The `weightsync serve` processes on the engine hosts (restartable on their port)."""

    def __init__(self, net: Network, model_dir: Path, disk_root: Path) -> None:
        self.net = net
        self.model_dir = model_dir
        self.disk_root = disk_root
        self.servers: list[ServerProcess | None] = [None] * len(ENGINE_HOSTS)
        self.logs: list[str] = []

    def _args(self, index: int) -> list[str]:
        return ["--host", self.net.address(ENGINE_HOSTS[index]), "--enable-lora", "--disk-root", str(self.disk_root),
                "--num-threads", "1", "--group-timeout", str(GROUP_TIMEOUT_S), "--session-timeout", "2"]

    def start(self, index: int, port: int = 0, env: dict[str, str] | None = None,
              args: Sequence[str] = ()) -> ServerProcess:
        server = launch_server(self.model_dir, args=[*self._args(index), "--port", str(port), *args],
                               prefix=self.net.prefix(ENGINE_HOSTS[index]), env=env)
        self.servers[index] = server
        return server

    def start_all(self) -> None:
        with ThreadPoolExecutor(len(ENGINE_HOSTS)) as pool:
            list(pool.map(self.start, range(len(ENGINE_HOSTS))))

    def restart(self, index: int, env: dict[str, str] | None = None, args: Sequence[str] = ()) -> None:
        """Start engine `index` again on its port (after it was killed), with `env` and `args` added."""
        old = self.servers[index]
        assert old is not None
        self.logs.append(old.log_text())
        old.close()
        self.start(index, int(old.url.rsplit(":", 1)[1]), env, args)

    def restart_all(self, env: dict[str, str] | None = None, args: Sequence[str] = ()) -> None:
        """`restart` every engine, at once (each on its own port, as `start_all` starts them)."""
        with ThreadPoolExecutor(len(ENGINE_HOSTS)) as pool:
            list(pool.map(lambda index: self.restart(index, env, args), range(len(ENGINE_HOSTS))))

    def url(self, index: int) -> str:
        server = self.servers[index]
        assert server is not None
        return server.url

    def pid(self, index: int) -> int:
        server = self.servers[index]
        assert server is not None
        return server.pid

    def close(self) -> None:
        for server in self.servers:
            if server is not None:
                self.logs.append(server.log_text())
                server.close()


@pytest.fixture(scope="module")
def multihost_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory every host sees: the model and the disk transport's versions."""
    return tmp_path_factory.mktemp("multihost")


@pytest.fixture(scope="module")
def engines(net: Network, multihost_root: Path) -> Iterator[Engines]:
    model_dir = make_tiny_model(multihost_root / "tiny")
    rig = Engines(net, model_dir, multihost_root / "versions")
    rig.disk_root.mkdir()
    try:
        rig.start_all()
        yield rig
    finally:
        rig.close()
    logged = [log for log in rig.logs if "Traceback" in log]
    assert not logged, f"an engine logged an unhandled error:\n{logged[0][-4000:]}"


class Trainer:
    """`trainer_main.py` on the trainer host: `call(op, **fields)` -> its JSON answer."""

    def __init__(self, net: Network, engines: Engines) -> None:
        spec = {"model_dir": str(engines.model_dir), "engines": [engines.url(i) for i in range(len(ENGINE_HOSTS))],
                "master_address": net.address("trainer"), "disk_root": str(engines.disk_root)}
        src = str(Path(__import__("weightsync").__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [*net.prefix("trainer"), sys.executable, str(_HERE / "trainer_main.py"), json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True, name="multihost-trainer").start()
        ready = self._answer()
        assert ready.get("ready"), ready

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _answer(self) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=ANSWER_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"the trainer gave no answer within {ANSWER_TIMEOUT_S}s") from None
        assert line is not None, f"the trainer exited with code {self.process.wait()}"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()
        answer = self._answer()
        assert "traceback" not in answer, answer["traceback"]
        return answer

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def trainer(net: Network, engines: Engines) -> Iterator[Trainer]:
    client = Trainer(net, engines)
    try:
        yield client
    finally:
        client.close()
