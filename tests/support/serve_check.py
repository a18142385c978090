"""Helpers for tests that run real servers (in tests/support/, which pyproject.toml puts
on sys.path for every test directory)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from weightsync.server.launch import ServerProcess, launch_server


def checked(server: ServerProcess) -> Iterator[ServerProcess]:
    """For a fixture (`yield from checked(launch_server(...))`): yields `server`, stops it,
    and fails if it logged a traceback (an unanticipated error, a 500)."""
    try:
        yield server
        log = server.log_text()
    finally:
        server.close()
    assert "Traceback" not in log, f"the server logged an unhandled error (a 500?):\n{log[-4000:]}"


@contextlib.contextmanager
def launch_servers(model_dir: str | os.PathLike[str], count: int,
                   args: Sequence[str] = ()) -> Iterator[list[ServerProcess]]:
    """`count` servers of `launch_server(model_dir, args=args)`, started at once (each start
    is mostly imports, which overlap); all of them are stopped on exit, and those that did
    start when another one failed to."""
    with ThreadPoolExecutor(count) as pool:
        starting = [pool.submit(launch_server, model_dir, args=args) for _ in range(count)]
    with contextlib.ExitStack() as stack:
        for future in starting:
            if future.exception() is None:
                stack.enter_context(future.result())
        yield [future.result() for future in starting]


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll server state until `predicate` holds (the state decides, not the clock; the
    timeout only turns a hang into a failure)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
