"""Start `weightsync serve` as a subprocess on a free port and wait until it answers.

For tests, the demo and benchmarks:

    with launch_server(model_dir, args=["--enable-lora"]) as server:
        httpx.post(f"{server.url}/generate", json={...})

The server runs in its own process group; leaving the block sends SIGTERM,
then SIGKILL after `stop_timeout_s`. Its stderr goes to a log file whose tail
is attached to any startup error (`ServerProcess.log_text()` reads it).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from weightsync.server.forkserver import ForkedProcess, ForkServer

LISTENING_RE = re.compile(r"^weightsync serve listening on (http://\S+)\s*$")


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; carries its log tail."""


ChildProcess = subprocess.Popen[str] | ForkedProcess
"""A server's process: a subprocess, or a child of the fork server."""

_forkserver: ForkServer | None = None


def use_forkserver(forkserver: ForkServer | None) -> ForkServer | None:
    """Start later `launch_server` calls in this process through `forkserver` (None: exec
    each as before). Calls that pass `env` or `prefix` exec regardless: see
    `weightsync.server.forkserver`. Returns the fork server used until now, to put back
    (`use_forkserver(previous)`) where a block used its own."""
    global _forkserver
    previous, _forkserver = _forkserver, forkserver
    return previous


class ServerProcess:
    """A running `weightsync serve` subprocess."""

    def __init__(self, process: ChildProcess, url: str, log_path: Path, *,
                 stop_timeout_s: float = 5.0, delete_log: bool = True) -> None:
        self.process = process
        self.url = url
        """`http://127.0.0.1:PORT`."""
        self.log_path = log_path
        self.stop_timeout_s = stop_timeout_s
        self.delete_log = delete_log

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_text(self) -> str:
        """Everything the server wrote to stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server's process group (fault injection) and reap it."""
        self._signal(signal.SIGKILL)
        self.process.wait()

    def close(self) -> None:
        """SIGTERM, then SIGKILL after `stop_timeout_s`; removes the log unless kept. Idempotent."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self.delete_log:
            self.log_path.unlink(missing_ok=True)

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def launch_server(
    model_dir: str | os.PathLike[str],
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
    log_dir: str | os.PathLike[str] | None = None,
    prefix: Sequence[str] = (),
) -> ServerProcess:
    """Run `python -m weightsync serve --model DIR --port 0 *args` and wait for /health.

    `env`: added to the current environment. `log_dir`: keeps the server's stderr log there (default: a
    temporary file, removed on close). `timeout_s`: ServerStartError, with the log tail, if the server
    exits or does not answer within it. `prefix`: goes before the command and must exec it in place, so
    signals reach the server (`["ip", "netns", "exec", "NS"]`); /health is then not asked from here
    (this process may not reach that namespace), only the listening line awaited. After
    `use_forkserver(...)`, a call without `env` and `prefix` forks the server from the fork server.
    """
    log_path = Path(tempfile.mkstemp(prefix="weightsync-serve-", suffix=".log", dir=log_dir)[1])
    argv = ["serve", "--model", str(model_dir), "--port", "0", *args]
    process: ChildProcess
    with open(log_path, "w") as log_file:
        if _forkserver is not None and env is None and not prefix:
            process = _forkserver.spawn(argv, stderr=log_file, timeout_s=timeout_s)
        else:
            process = subprocess.Popen([*prefix, sys.executable, "-m", "weightsync", *argv], stdout=subprocess.PIPE,
                                       stderr=log_file, text=True, start_new_session=True,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    deadline = time.monotonic() + timeout_s
    server = ServerProcess(process, "", log_path, delete_log=log_dir is None)
    try:
        server.url = _wait_for_url(process, deadline)
        if not prefix:
            wait_for_health(server.url, deadline, server.process)
    except ServerStartError as e:
        tail = server.log_text()[-4000:]
        server.close()
        raise ServerStartError(f"{e}\n--- server log (tail) ---\n{tail}") from None
    except BaseException:
        server.close()
        raise
    return server


def _wait_for_url(process: ChildProcess, deadline: float) -> str:
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name="weightsync-serve-stdout", daemon=True).start()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ServerStartError(f"weightsync serve printed no listening line in time (pid {process.pid})")
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            continue
        if line is None:
            raise ServerStartError(f"weightsync serve exited with code {process.wait()} before listening")
        match = LISTENING_RE.match(line)
        if match:
            return match.group(1)


def wait_for_health(url: str, deadline: float, process: ChildProcess | None = None) -> None:
    """Return once `url` answers /health with 200 (before the monotonic `deadline`);
    ServerStartError when `process` (the server, if this side started it) exits first
    or the deadline passes."""
    import httpx

    delay = 0.05
    while True:
        if process is not None and process.poll() is not None:
            raise ServerStartError(f"weightsync serve exited with code {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise ServerStartError(f"weightsync serve at {url} did not answer /health in time")
        time.sleep(delay)  # polling interval, not synchronisation: /health decides
        delay = min(delay * 2, 0.5)
