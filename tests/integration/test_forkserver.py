"""`weightsync.server.forkserver`: a server forked from the fork server is the server
`python -m weightsync serve` would have started (same answers, bit for bit; same exit
codes; the caller's working directory), and the fork server stops what it forked."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from server_fixtures import Client
from weightsync.server.forkserver import ForkServer, ForkServerError
from weightsync.server.launch import ServerProcess, ServerStartError, launch_server, use_forkserver

PROMPT = [5, 17, 42, 7]


@pytest.fixture(scope="module", autouse=True)
def session_forkserver_put_back() -> Iterator[None]:
    """Every test here uses a fork server of its own, or none, and puts the session's back:
    the tests after this module start their servers from it (a test that left `None` made
    every later start of the session exec a fresh interpreter: 5 s instead of 1 s)."""
    session = use_forkserver(None)
    use_forkserver(session)
    yield
    assert use_forkserver(session) is session, "a test left launch_server on another fork server"


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    """A fork server of this module's own (the session's is used by every other test)."""
    with ForkServer.start() as forks:
        yield forks


@pytest.fixture
def forked(forks: ForkServer) -> Iterator[None]:
    """launch_server() forks from this module's fork server for one test."""
    previous = use_forkserver(forks)
    yield
    use_forkserver(previous)


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def answers(server: ServerProcess) -> tuple[list[int], dict[str, str]]:
    client = Client(server.url)
    try:
        return client.generate(PROMPT, sampling_params={"max_new_tokens": 6})["output_ids"], client.digests()
    finally:
        client.close()


def test_a_forked_server_answers_as_an_execd_one(tiny_model_dir: Path, forks: ForkServer, forked: None) -> None:
    # env= always execs a fresh interpreter (variables that may matter at import)
    with launch_server(tiny_model_dir, args=["--num-threads", "1"], env={}) as execd:
        assert parent_pid(execd.pid) == os.getpid()
        expected = answers(execd)
    with launch_server(tiny_model_dir, args=["--num-threads", "1"]) as child:
        assert parent_pid(child.pid) == forks.process.pid
        assert os.getpgid(child.pid) == child.pid  # its own process group, as start_new_session gives
        assert answers(child) == expected  # float32 tokens and the served bytes' digests, exactly


def test_the_caller_s_working_directory(tiny_model_dir: Path, forked: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tiny_model_dir.parent)
    with launch_server(tiny_model_dir.name, args=["--num-threads", "1"]) as server:
        assert answers(server)[0]


def test_exit_codes_come_back(tiny_model_dir: Path, forked: None) -> None:
    missing = tiny_model_dir.parent / "no-such-model"
    with pytest.raises(ServerStartError, match=r"exited with code 2 before listening(.|\n)*no-such-model"):
        launch_server(missing)
    server = launch_server(tiny_model_dir, args=["--num-threads", "1"])
    server.kill()
    assert server.process.returncode == -9
    server.close()


def test_two_at_once_then_closing_the_fork_server_stops_them(tiny_model_dir: Path) -> None:
    """Two servers asked for at once while the fork server is still importing (both wait for
    it to be ready); closing the fork server kills and reaps them. A process forked from the
    caller (a multiprocessing child, a vLLM engine core) inherits the fork server's stdin pipe
    and keeps it open meanwhile: close() stops the fork server regardless, cleanly (exit code 0,
    not killed after close()'s 30 s wait)."""
    with ForkServer.start() as own:
        previous = use_forkserver(own)
        try:
            with ThreadPoolExecutor(2) as pool:
                servers = list(pool.map(lambda _: launch_server(tiny_model_dir, args=["--num-threads", "1"]),
                                        range(2)))
        finally:
            use_forkserver(previous)
        for server in servers:
            assert parent_pid(server.pid) == own.process.pid
            assert answers(server)[0]
        holder = os.fork()
        if holder == 0:  # holds every inherited descriptor, the fork server's stdin among them
            time.sleep(120)
            os._exit(0)
    try:
        assert own.process.returncode == 0
        for server in servers:
            assert not Path(f"/proc/{server.pid}").exists()  # killed and reaped by the fork server
            assert server.process.poll() == -9
            server.close()
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)


def test_a_fork_server_that_is_gone_is_named(tiny_model_dir: Path) -> None:
    own = ForkServer.start()
    own._wait_ready(time.monotonic() + 120)
    own.process.kill()
    own.process.wait()
    previous = use_forkserver(own)
    try:
        with pytest.raises(ForkServerError, match=r"did not take `weightsync serve .*exit code: -9"):
            launch_server(tiny_model_dir)
    finally:
        use_forkserver(previous)
        own.close()
