"""How faults are injected: a transport that breaks one bucket, and trainers in
child processes that can be killed mid-push.

Fakes appear only here, and only to inject faults: `FaultyTransport` wraps a
real transport; `_CutBodyEngine` and `fail_in_commit_round` wrap real engine
clients. Everything else a
scenario touches is real (servers, sockets, shared memory, files, gloo).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from weightsync.engines.base import Delivery, EngineUpdate, Link
from weightsync.engines.sglang import SGLangEngine
from weightsync.errors import WeightSyncError
from weightsync.formats.version_dir import bucket_file_name
from weightsync.formats.wire import FrameHeader, encode_prefix
from weightsync.manifest import BucketMeta, Manifest
from weightsync.push.sync import WeightSync
from weightsync.reports import Ack
from weightsync.transports import make_transport
from weightsync.transports.base import Transport, typed
from weightsync.transports.shm import ShmLink
from weightsync_tools.faults.rig import DictSource

# -- injecting faults --------------------------------------------------------------------------


class FaultyTransport:
    """A real transport with one fault at bucket `at_bucket` of push number `at_push`
    (1-based); every other bucket and push passes through untouched.

    Faults: "flip" one byte of the packed bucket after it was hashed; "truncate" it
    (http: a short frame, broadcast: a short broadcast, disk: a short file, shm: a
    slot advertised shorter than the bucket); "stop" (SIGSTOP) or "kill" the engine
    just before the bucket goes out (`rig.stop()`, `rig.kill()`: a `Rig` or anything
    with those methods); "block" before delivering or "block-send" before
    broadcasting: call `on_fire`, then wait for `release` (a trainer stuck there);
    "call": call `on_fire` just before the bucket goes out, then deliver it (a fault
    made elsewhere at that moment, e.g. a network link cut).
    """

    def __init__(self, inner: Transport, fault: str, *, at_bucket: int = 1, at_push: int = 1,
                 rig: Any = None, cut_bytes: int = 64, on_fire: Callable[[], None] | None = None,
                 block_s: float | None = 120.0) -> None:
        self.inner = inner
        self.name = inner.name
        self.per_bucket_delivery = inner.per_bucket_delivery
        self.adapter_in_one_bucket = inner.adapter_in_one_bucket
        self.survives_failure = inner.survives_failure
        self.buffer_device = inner.buffer_device
        self.same_host_only = inner.same_host_only
        self.relays = inner.relays
        self.trainer_address = inner.trainer_address
        self.fault = fault
        self.at_bucket = at_bucket
        self.at_push = at_push
        self.rig = rig
        self.cut_bytes = cut_bytes
        self.on_fire = on_fire
        self.block_s = block_s
        self.fired = threading.Event()
        self.release = threading.Event()
        self.links: list[Link] = []
        """The links of the latest session (a killed trainer's shm segment is found here)."""
        self._pushes = 0

    def _armed(self, bucket: BucketMeta | None = None) -> bool:
        return (self._pushes == self.at_push and not self.fired.is_set()
                and (bucket is None or bucket.index == self.at_bucket))

    def _fire(self) -> None:
        self.fired.set()
        if self.on_fire is not None:
            self.on_fire()

    def open(self, engine_ranks: Sequence[int], *, max_bucket_bytes: int, leased_buckets: int = 0) -> list[Link]:
        links = self.inner.open(engine_ranks, max_bucket_bytes=max_bucket_bytes, leased_buckets=leased_buckets)
        self.links = list(links)
        if self.fault == "truncate" and self.name == "shm" and self._pushes + 1 == self.at_push:
            short = max(1, max_bucket_bytes - self.cut_bytes)
            return [dataclasses.replace(typed(link, ShmLink), slot_bytes=short) for link in links]
        return links

    def establish(self) -> None:
        self.inner.establish()

    def begin(self, manifest: Manifest) -> None:
        self._pushes += 1
        if self.fault == "truncate" and self.name == "shm" and self._armed():
            self._fire()  # the short slot went out with the links
        self.inner.begin(manifest)

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        return self.inner.slot(index, nbytes)

    def deliver(self, bucket: BucketMeta, buffer: torch.Tensor) -> Delivery:
        if not self._armed(bucket) or self.fault == "block-send":
            return self.inner.deliver(bucket, buffer)
        if self.fault == "flip":
            self._fire()
            middle = bucket.nbytes // 2
            buffer[middle] = buffer[middle] ^ 0xFF
        elif self.fault == "stop":
            assert self.rig is not None
            self._fire()
            self.rig.stop()
        elif self.fault == "kill":
            assert self.rig is not None
            self._fire()
            self.rig.kill()
        elif self.fault == "block":
            self._fire()
            self.release.wait(self.block_s)
        elif self.fault == "call":
            self._fire()
        elif self.fault == "truncate":
            return self._truncate(bucket, buffer)
        return self.inner.deliver(bucket, buffer)

    def _truncate(self, bucket: BucketMeta, buffer: torch.Tensor) -> Delivery:
        short = max(0, bucket.nbytes - self.cut_bytes)
        delivery = self.inner.deliver(bucket, buffer)
        if self.name == "http":
            self._fire()
            return Delivery(transport="http", data=buffer[:short])
        if self.name == "disk":
            self._fire()
            [path] = Path(self.inner.root).glob(f".tmp-v*/{bucket_file_name(bucket.index)}")  # type: ignore[attr-defined]
            os.truncate(path, path.stat().st_size - (bucket.nbytes - short))
        if self.name == "broadcast":
            self._fire()  # send() broadcasts the short buffer
        return delivery

    def send(self, bucket: BucketMeta, buffer: torch.Tensor) -> None:
        if self.name == "broadcast" and bucket.index == self.at_bucket and self._pushes == self.at_push:
            if self.fault == "truncate":
                self.inner.send(bucket, buffer[: max(0, bucket.nbytes - self.cut_bytes)])
                return
            if self.fault == "block-send" and not self.fired.is_set():
                self._fire()
                self.release.wait(self.block_s)
        self.inner.send(bucket, buffer)

    def finish(self, manifest: Manifest) -> None:
        self.inner.finish(manifest)

    def committed(self, acks: Sequence[Ack]) -> None:
        self.inner.committed(acks)

    def discard(self, version: int) -> None:
        self.inner.discard(version)

    def close(self) -> None:
        self.inner.close()


def faulty(transport: str, fault: str, *, timeout_s: float, disk_root: str | Path | None = None,
           **options: Any) -> FaultyTransport:
    """A `FaultyTransport(real, fault, **options)` around the transport `WeightSync` would
    make by that name; pass it as `WeightSync(transport=...)`."""
    return FaultyTransport(make_transport(transport, timeout_s=timeout_s, disk_root=disk_root), fault, **options)


class ChildTrainer:
    """A trainer in a child process (`python -m weightsync_tools.faults child SPEC`, see
    `child_main`), whose output lines can be waited for and which can be SIGKILLed."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "weightsync_tools.faults", "child", json.dumps(spec)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, name="weightsync-child-stdout", daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout_s: float) -> str | None:
        """The first output line starting with `prefix`, or None (exit or timeout)."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                break
            if line is None:
                return None
            self.output.append(line)
            if line.startswith(prefix):
                return line
        return None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def tail(self) -> str:
        return "\n".join(self.output[-20:])

    def __enter__(self) -> ChildTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        if self.process.stdout is not None:
            self.process.stdout.close()


CHILD_READY_TIMEOUT_S = 120.0


def segments_left(ready_line: str) -> list[str]:
    """The shm segments a killed child trainer named on its READY line that still exist
    (the next segment created on this host removes them: `transports.shmem.remove_orphans`)."""
    from weightsync.transports.shmem import SHM_DIR, check_name

    names = json.loads(ready_line.removeprefix("READY").strip() or "[]")
    return [name for name in names if (SHM_DIR / check_name(name)).exists()]


class _CommitsFirst:
    """A real engine client that says when its commit answered."""

    def __init__(self, inner: Any, committed: threading.Event) -> None:
        self.inner = inner
        self.committed = committed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def commit(self, manifest: Manifest, update: EngineUpdate) -> Ack:
        ack = self.inner.commit(manifest, update)
        self.committed.set()
        return ack


class _FailsInCommit:
    """A real engine client whose engine fails in the commit round: once the other replica
    committed, `on_fire` runs (kill its server, cut its link), then the real commit goes out."""

    def __init__(self, inner: Any, other_committed: threading.Event, on_fire: Callable[[], None],
                 wait_s: float) -> None:
        self.inner = inner
        self.other_committed = other_committed
        self.on_fire = on_fire
        self.wait_s = wait_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def commit(self, manifest: Manifest, update: EngineUpdate) -> Ack:
        if not self.other_committed.wait(self.wait_s):
            raise AssertionError(f"the other replica did not commit within {self.wait_s:.0f}s")
        self.on_fire()
        ack: Ack = self.inner.commit(manifest, update)
        return ack


def fail_in_commit_round(engines: Sequence[Any], victim: int, witness: int, on_fire: Callable[[], None], *,
                         wait_s: float = 60.0) -> list[Any]:
    """`engines`, with engine `victim` failing in the commit round (`on_fire`, then its real
    commit) only after engine `witness` committed: the replica lost between another's
    commit and its own, deterministically."""
    committed = threading.Event()
    wrapped = list(engines)
    wrapped[witness] = _CommitsFirst(engines[witness], committed)
    wrapped[victim] = _FailsInCommit(engines[victim], committed, on_fire, wait_s)
    return wrapped


# -- the trainer child process -----------------------------------------------------------------


class _CutBodyEngine:
    """An SGLangEngine whose upload of bucket `at_bucket` stops halfway through the
    request body and hangs there (its process is then killed)."""

    def __init__(self, inner: SGLangEngine, at_bucket: int, on_fire: Callable[[], None],
                 api_key: str | None) -> None:
        self.inner = inner
        self.at_bucket = at_bucket
        self.on_fire = on_fire
        self.api_key = api_key
        self.version = -1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin(self, manifest: Manifest, update: EngineUpdate) -> None:
        self.version = manifest.version
        self.inner.begin(manifest, update)

    def receive(self, bucket: BucketMeta, delivery: Delivery, update: EngineUpdate) -> None:
        if bucket.index != self.at_bucket:
            return self.inner.receive(bucket, delivery, update)
        assert bucket.digest is not None
        prefix = encode_prefix(FrameHeader(version=self.version, index=bucket.index,
                                           nbytes=bucket.nbytes, digest=bucket.digest))
        payload = bytes(delivery.data.numpy().tobytes())

        def body() -> Iterator[bytes]:
            yield prefix
            yield payload[: len(payload) // 2]
            self.on_fire()
            threading.Event().wait()

        headers = {"Content-Type": "application/octet-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        httpx.post(f"{self.inner.url}/weightsync/bucket", content=body(), headers=headers, timeout=None)
        return None


def child_main(spec: dict[str, Any]) -> int:
    """Push `spec["weights"]` once with the fault `spec["fault"]`, printing "READY" when
    the fault fires and "RESULT {json}" at the end."""
    from safetensors.torch import load_file

    made: list[FaultyTransport] = []

    def announce() -> None:  # with the shm segments this trainer made (nobody unlinks them once it is killed)
        names = sorted({link.shm_name for transport in made for link in transport.links if isinstance(link, ShmLink)})
        print("READY " + json.dumps(names), flush=True)

    loaded = load_file(spec["weights"])
    weights = {name: loaded[name] for name in spec["order"]}  # the trainer's order, which buckets follow
    engine: Any = SGLangEngine(spec["url"], api_key=spec["api_key"], timeout_s=spec["timeout_s"])
    if spec.get("engine") == "vllm":
        from weightsync.engines.vllm.client import VLLMEngine

        engine = VLLMEngine(spec["url"], api_key=spec["api_key"], timeout_s=spec["timeout_s"])
    if spec.get("engine") == "vllm-transfer":  # vLLM's weight-transfer API, backend "weightsync"
        from weightsync.engines.vllm.transfer_client import VLLMTransferEngine

        engine = VLLMTransferEngine(spec["url"], api_key=spec["api_key"], timeout_s=spec["timeout_s"])
    fault = spec.get("fault")
    if fault == "block-body":
        engine = _CutBodyEngine(engine, spec["at_bucket"], announce, spec["api_key"])
    transport: Transport = make_transport(spec["transport"], timeout_s=spec["timeout_s"], disk_root=spec["disk_root"])
    if fault in ("block", "block-send"):
        made.append(FaultyTransport(transport, fault, at_bucket=spec["at_bucket"], on_fire=announce, block_s=None))
        transport = made[0]
    if spec.get("fsize_limit"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], hard))
    started = time.monotonic()
    result: dict[str, Any] = {"ok": True}
    try:
        with WeightSync([engine], transport=transport, bucket_bytes=spec["bucket_bytes"],
                        timeout_s=spec["timeout_s"], commit=spec.get("commit", "staged")) as sync:
            sync.push(DictSource(weights), version=spec["version"])
    except (WeightSyncError, OSError) as e:
        result = {"ok": False, "error_type": type(e).__name__, "error": str(e)}
    result["seconds"] = time.monotonic() - started
    print("RESULT " + json.dumps(result), flush=True)
    return 0
