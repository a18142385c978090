"""Start `weightsync serve` processes without paying their imports each time.

A fork server imports what a server imports (torch, transformers, the app) once, then forks one
child per server, which runs `cli.main.main` as `python -m weightsync serve ARGS` would. For test
suites that start many servers: after `use_forkserver(ForkServer.start())`, `launch_server` calls
without `env=` or `prefix` fork from it; those with either still exec a fresh interpreter. What a
child shares, the socket protocol, when it exits: docs/ARCHITECTURE.md, "Design notes, by module".
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

# What a server imports before it listens; the models' own modules load in the child.
PRELOAD = (
    "weightsync.cli.main",
    "weightsync.cli.serve",
    "weightsync.server.serving",
    "weightsync.server.app",
    "weightsync.server.state",
    "weightsync.server.runner",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
)


class ForkServerError(RuntimeError):
    """The fork server did not start, or is gone; carries its log tail."""


class ForkedProcess:
    """A server forked by the fork server: what `ServerProcess` needs of a `subprocess.Popen`
    (`pid`, `stdout`, `poll`, `wait`, `returncode`). Signal it with `os.killpg(pid, ...)`."""

    def __init__(self, connection: socket.socket, pid: int, stdout: IO[str], args: Sequence[str]) -> None:
        self.pid = pid
        self.stdout: IO[str] | None = stdout
        self.args = list(args)
        self.returncode: int | None = None
        self._connection = connection

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read_exit()
        assert self.returncode is not None
        return self.returncode

    def _read_exit(self) -> None:
        line = _recv_line(self._connection)
        self._connection.close()
        if not line:
            raise ForkServerError(f"the fork server closed before server pid {self.pid} exited")
        self.returncode = int(json.loads(line)["returncode"])


class ForkServer:
    """A running fork server (`ForkServer.start()`); `close()` stops it and any child left."""

    def __init__(self, process: subprocess.Popen[bytes], socket_path: Path, log_path: Path) -> None:
        self.process = process
        self.socket_path = socket_path
        self.log_path = log_path
        self._ready = False
        self._ready_lock = threading.Lock()  # servers started at once (serve_check.launch_servers)

    @classmethod
    def start(cls) -> ForkServer:
        """Start one in the background: it imports for a few seconds while the caller goes on;
        the first `spawn` waits for it."""
        root = Path(tempfile.mkdtemp(prefix="weightsync-forkserver-"))  # mode 0700
        log_path = root / "forkserver.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "weightsync.server.forkserver", str(root / "socket")],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        return cls(process, root / "socket", log_path)

    def spawn(self, argv: Sequence[str], *, stderr: IO[Any], timeout_s: float) -> ForkedProcess:
        """Fork `weightsync ARGV` (e.g. `["serve", "--model", DIR]`); its stdout comes back as
        the result's `stdout`, its stderr goes to the open file `stderr`."""
        self._wait_ready(time.monotonic() + timeout_s)
        read_end, write_end = os.pipe()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.settimeout(timeout_s)
            connection.connect(str(self.socket_path))
            socket.send_fds(connection, [b"R"], [write_end, stderr.fileno()])
            request = {"argv": list(argv), "cwd": os.getcwd(), "env": {**os.environ, "PYTHONUNBUFFERED": "1"}}
            connection.sendall(json.dumps(request).encode() + b"\n")
            reply = _recv_line(connection)
            connection.settimeout(None)
        except BaseException as e:
            connection.close()
            os.close(read_end)
            if isinstance(e, OSError):  # it is gone (its socket refuses) or did not answer in time
                raise ForkServerError(f"the fork server did not take `weightsync {' '.join(argv)}`: {e!r} "
                                      f"(its exit code: {self.process.poll()})\n{self._log_tail()}") from e
            raise
        finally:
            os.close(write_end)
        if not reply:
            connection.close()
            os.close(read_end)
            raise ForkServerError(f"the fork server did not fork `weightsync {' '.join(argv)}`\n{self._log_tail()}")
        stdout = os.fdopen(read_end, "r", encoding="utf-8", errors="replace")
        return ForkedProcess(connection, int(json.loads(reply)["pid"]), stdout, ["weightsync", *argv])

    def close(self) -> None:
        """Stop it (it stops the servers it forked that still run); idempotent."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        if self.process.poll() is None:
            self.process.terminate()  # its signal to stop (the stdin pipe may be held open elsewhere)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        for path in (self.socket_path, self.log_path):
            path.unlink(missing_ok=True)
        self.socket_path.parent.rmdir()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _wait_ready(self, deadline: float) -> None:
        with self._ready_lock:
            if not self._ready:
                self._read_ready(deadline)

    def _read_ready(self, deadline: float) -> None:
        assert self.process.stdout is not None
        while not select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            if time.monotonic() >= deadline:
                raise ForkServerError(f"the fork server was not ready in time\n{self._log_tail()}")
        if self.process.stdout.readline() != b"ready\n":
            raise ForkServerError(f"the fork server exited with code {self.process.wait()}\n{self._log_tail()}")
        self._ready = True

    def _log_tail(self) -> str:
        try:
            return "--- fork server log (tail) ---\n" + self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""


def _recv_line(connection: socket.socket) -> bytes:
    """One reply line, read unbuffered (a buffered reader could swallow the exit line that
    follows the pid line); b"" if the connection closed first."""
    line = b""
    while not line.endswith(b"\n"):
        byte = connection.recv(1)
        if not byte:
            return b""
        line += byte
    return line


def _serve_forks(socket_path: str) -> int:
    """The fork server's loop. Returns 0 in the fork server on SIGTERM or when its stdin closes; in each
    child, the exit code of `weightsync ARGV`, for the interpreter to exit with."""
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a handler, so the wakeup fd hears it
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    children: dict[int, socket.socket] = {}
    stdin = sys.stdin.fileno()
    print("ready", flush=True)
    while not stopping:
        readable = select.select([listener, stdin, wake_read], [], [])[0]
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(children)
        if stdin in readable and not os.read(stdin, 4096):
            break
        if listener in readable:
            connection, _ = listener.accept()
            connection.settimeout(30)
            _, fds, _, _ = socket.recv_fds(connection, 1, 2)
            request = json.loads(connection.makefile("rb").readline())
            pid = os.fork()
            if pid == 0:
                for other in (listener, connection, *children.values()):
                    other.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.close(wake_read)
                os.close(wake_write)
                return _run_child(request, fds)
            for fd in fds:
                os.close(fd)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = connection
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    while children:
        _reap(children, block=True)
    return 0


def _reap(children: dict[int, socket.socket], *, block: bool = False) -> None:
    """Tell each exited child's connection its exit code."""
    while children:
        pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):  # the caller is gone
                connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            connection.close()
        if block:
            return


def _run_child(request: dict[str, Any], fds: list[int]) -> int:
    os.setsid()
    stdout_fd, stderr_fd = fds
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = [str(arg) for arg in request["argv"]]
    sys.argv = ["weightsync", *argv]
    from weightsync.cli.main import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(_serve_forks(sys.argv[1]))
