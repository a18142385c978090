"""Start and stop a `vllm serve` with weightsync's worker extension and the routes it needs (tests, demo, bench).

It knows nothing of the update protocol (that is `client.py`). What it switches on and why:
docs/VLLM.md, "Starting a server".
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from weightsync.engines.vllm.worker import EXTENSION
from weightsync.errors import EngineError

log = logging.getLogger(__name__)

DEFAULT_KV_CACHE_BYTES = 1 << 30
"""The KV cache a launched server gets unless the caller sizes it: 1 GiB, about 87k tokens of
a 0.5B Qwen2.5 in bfloat16. Always bytes: vLLM on CPU otherwise takes `--gpu-memory-utilization`
of the NUMA node's memory, which on a VM can be a fraction of what the machine has."""

KV_SIZING_FLAGS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")
"""Flags by which a caller sizes the KV cache itself (a fraction only if the caller passes one)."""

DEFAULT_ARGS: tuple[tuple[str, str | None], ...] = (
    ("--enforce-eager", None),  # torch.compile doubles the start time and buys nothing for tiny models
    ("--enable-scale-out", None),  # /inference/v1/generate: token ids, logprobs, weight versions
)


@dataclass(frozen=True, kw_only=True)
class VLLMServer:
    """A running `vllm serve` started by `launch_vllm_server`."""

    url: str
    """Base URL, e.g. "http://127.0.0.1:38123"."""
    process: subprocess.Popen[bytes]
    """The server process (leader of its own process group)."""
    log_path: Path
    """Where its stdout and stderr go."""
    start_seconds: float
    """Seconds from launch until /health answered."""

    def log_tail(self, num_lines: int = 40) -> str:
        """The last lines of the server's log."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-num_lines:])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(model_dir: str | os.PathLike[str], *, port: int, host: str = "127.0.0.1",
                   args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> list[str]:
    """The server's command line, with weightsync's extension and `DEFAULT_ARGS`, and
    `--kv-cache-memory-bytes DEFAULT_KV_CACHE_BYTES` unless `args` size the KV cache
    (`KV_SIZING_FLAGS`) or `env` (default: this process's) sets `VLLM_CPU_KVCACHE_SPACE`."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", host, "--port", str(port), "--worker-extension-cls", EXTENSION]
    defaults = list(DEFAULT_ARGS)
    if not _kv_sized(args, os.environ if env is None else env):
        defaults.append(("--kv-cache-memory-bytes", str(DEFAULT_KV_CACHE_BYTES)))
    for flag, value in defaults:
        if not _has_flag(args, flag):
            command += [flag] if value is None else [flag, value]
    return command + list(args)


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _kv_sized(args: Sequence[str], env: Mapping[str, str]) -> bool:
    return any(_has_flag(args, flag) for flag in KV_SIZING_FLAGS) or bool(env.get("VLLM_CPU_KVCACHE_SPACE"))


@contextlib.contextmanager
def launch_vllm_server(
    model_dir: str | os.PathLike[str],
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 240.0,
    host: str = "127.0.0.1",
) -> Iterator[VLLMServer]:
    """Run `vllm serve model_dir` with weightsync's worker extension until the block ends.

    `args` go to `vllm serve` after the defaults (e.g. `["--dtype", "float32",
    "--enable-lora", "--max-lora-rank", "16"]`); `env` is added to this
    process's environment. The KV cache is `DEFAULT_KV_CACHE_BYTES` (1 GiB) unless
    you size it: `args=["--kv-cache-memory-bytes", str(8 << 30)]` (bytes; vLLM also
    takes "8G"), or `VLLM_CPU_KVCACHE_SPACE=8` (GiB) in `env`. A
    `--gpu-memory-utilization` you pass is passed through, but on CPU it is a fraction
    of the NUMA node's memory, which on a VM can be far less than the machine's.
    Raises EngineError with the server's last log lines if it exits or is not
    ready within `timeout_s`. The log file is deleted when the block ends
    normally and kept (its path logged) after an error.
    """
    port = free_port(host)
    full_env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", **(env or {})}
    command = server_command(model_dir, port=port, host=host, args=args, env=full_env)
    log_file = tempfile.NamedTemporaryFile(prefix="weightsync-vllm-", suffix=".log", delete=False)  # noqa: SIM115
    log_path = Path(log_file.name)
    log.info("starting vLLM: %s (log: %s)", " ".join(command), log_path)
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=full_env,
                               start_new_session=True)
    log_file.close()
    url = f"http://{host}:{port}"
    try:
        _wait_ready(url, process, log_path, timeout_s)
        server = VLLMServer(url=url, process=process, log_path=log_path,
                            start_seconds=time.perf_counter() - started)
        log.info("vLLM ready at %s after %.1fs", url, server.start_seconds)
        yield server
    except BaseException:
        log.warning("vLLM's log is kept at %s", log_path)
        raise
    else:
        log_path.unlink(missing_ok=True)
    finally:
        stop_process_group(process)


def _wait_ready(url: str, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EngineError(url, f"vLLM exited with code {process.returncode} while starting; "
                              f"its log ({log_path}) ends with:\n{_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise EngineError(url, f"vLLM was not ready within {timeout_s:.0f}s; its log ({log_path}) ends with:\n"
                      f"{_tail(log_path)}")


def _tail(path: Path, num_lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except FileNotFoundError:
        return "(no log)"


def stop_process_group(process: subprocess.Popen[bytes], *, grace_s: float = 20.0) -> None:
    """SIGTERM the process group led by `process`, then SIGKILL what is left after `grace_s`."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("vLLM (pid %d) ignored SIGTERM for %.0fs; killing it", process.pid, grace_s)
    # Engine-core and worker children may outlive the leader: kill the group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)
