"""The machine's own limits for moving N bytes, measured the plainest way: copy, gloo, xxh3, wsmix64,
tcp, disk.

Each moves the same bytes, in the same chunks, as the sync it is compared with, with no weightsync
code on the path (but the digest it measures); best of `repeats`. Receiving processes are children
of this module, always reaped; no fixed ports. Measures only: no printing, no transport or engine.
What each limit is: docs/PERFORMANCE.md ("How the bench measures").
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

LIMIT_NAMES = ("copy", "gloo", "xxh3", "wsmix64", "tcp", "disk")
CHILD_TIMEOUT_S = 300.0
IN_PROCESS_REPEATS = 5


@dataclass(frozen=True, kw_only=True)
class Limit:
    """One limit: `num_bytes` moved in `chunk_bytes` chunks, best of `runs`."""

    name: str
    """One of LIMIT_NAMES."""
    num_bytes: int
    """Bytes moved per run."""
    chunk_bytes: int
    """Chunk size (the sync's bucket size)."""
    runs: tuple[float, ...] = field(default_factory=tuple)
    """Seconds of every run."""

    @property
    def seconds(self) -> float:
        return min(self.runs)

    @property
    def gbps(self) -> float:
        """Decimal gigabytes per second of the best run."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_bytes": self.num_bytes, "chunk_bytes": self.chunk_bytes,
                "seconds": self.seconds, "gbps": self.gbps, "runs": list(self.runs)}


def _chunks(num_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(start, min(num_bytes, start + chunk_bytes)) for start in range(0, num_bytes, chunk_bytes)]


def _touched(num_bytes: int, value: int = 1) -> torch.Tensor:
    """A uint8 buffer whose pages are all faulted in."""
    buf = torch.empty(num_bytes, dtype=torch.uint8)
    buf.fill_(value)
    return buf


def _best_of(repeats: int, run: Callable[[], float]) -> tuple[float, ...]:
    return tuple(run() for _ in range(max(1, repeats)))


# -- in this process -------------------------------------------------------------


def measure_copy(num_bytes: int, chunk_bytes: int, *, repeats: int = 3) -> Limit:
    """`copy_` of `num_bytes` into a preallocated buffer, chunk by chunk."""
    src, dst = _touched(num_bytes, 7), _touched(num_bytes, 0)
    spans = _chunks(num_bytes, chunk_bytes)

    def run() -> float:
        t0 = time.perf_counter()
        for a, b in spans:
            dst[a:b].copy_(src[a:b])
        return time.perf_counter() - t0

    return Limit(name="copy", num_bytes=num_bytes, chunk_bytes=chunk_bytes, runs=_best_of(repeats, run))


def measure_xxh3(num_bytes: int, chunk_bytes: int, *, repeats: int = 3) -> Limit:
    """xxh3_64 of `num_bytes`, one digest per chunk (as one per bucket)."""
    import xxhash

    data = _touched(num_bytes, 3).numpy()
    spans = _chunks(num_bytes, chunk_bytes)

    def run() -> float:
        t0 = time.perf_counter()
        for a, b in spans:
            xxhash.xxh3_64_hexdigest(data[a:b].data)
        return time.perf_counter() - t0

    return Limit(name="xxh3", num_bytes=num_bytes, chunk_bytes=chunk_bytes, runs=_best_of(repeats, run))


def measure_wsmix64(num_bytes: int, chunk_bytes: int, *, repeats: int = 3, device: str = "cpu") -> Limit:
    """wsmix64 of `num_bytes` on `device`, one digest per chunk (as one per bucket)."""
    from weightsync.digests import WSMIX64, digest

    data = _touched(num_bytes, 3).to(device)
    spans = _chunks(num_bytes, chunk_bytes)

    def run() -> float:
        t0 = time.perf_counter()
        for a, b in spans:
            digest(data[a:b], WSMIX64)  # reads the sum back: waits for the device
        return time.perf_counter() - t0

    return Limit(name="wsmix64", num_bytes=num_bytes, chunk_bytes=chunk_bytes, runs=_best_of(repeats, run))


def measure_disk(num_bytes: int, chunk_bytes: int, directory: Path, *, repeats: int = 1) -> Limit:
    """Write `num_bytes` to a new file under `directory` and fsync it; the file is removed."""
    data = _touched(min(num_bytes, chunk_bytes), 5).numpy()
    spans = _chunks(num_bytes, chunk_bytes)
    directory.mkdir(parents=True, exist_ok=True)

    def run() -> float:
        path = directory / f".limit-disk-{os.getpid()}"
        try:
            t0 = time.perf_counter()
            with open(path, "wb", buffering=0) as f:
                for a, b in spans:
                    f.write(data[: b - a].data)
                os.fsync(f.fileno())
            return time.perf_counter() - t0
        finally:
            path.unlink(missing_ok=True)

    return Limit(name="disk", num_bytes=num_bytes, chunk_bytes=chunk_bytes, runs=_best_of(repeats, run))


# -- with a second process -------------------------------------------------------


@contextlib.contextmanager
def _receiver(*args: str | int, stdout: int | None = None, grace_s: float = 30.0) -> Iterator[subprocess.Popen[str]]:
    """`python -m weightsync_tools.bench.limits ARGS`, the receiving side of a limit. Reaped on
    exit: given `grace_s` to finish after a clean run, killed at once after an error."""
    command = [sys.executable, "-m", "weightsync_tools.bench.limits", *map(str, args)]
    child = subprocess.Popen(command, stdout=stdout, text=True, start_new_session=True)
    try:
        yield child
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(grace_s)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def _gloo_group(store_path: str, rank: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    store = dist.FileStore(store_path, 2)
    return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))


def _broadcast(group: Any, tensor: torch.Tensor, root: int, timeout_s: float) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait(timedelta(seconds=timeout_s))


def _gloo_receiver(store_path: str, num_bytes: int, chunk_bytes: int, repeats: int) -> None:
    group = _gloo_group(store_path, 1, CHILD_TIMEOUT_S)
    buf = _touched(num_bytes, 0)
    flag = torch.zeros(1, dtype=torch.uint8)
    for _ in range(repeats):
        _broadcast(group, flag, 0, CHILD_TIMEOUT_S)  # start
        for a, b in _chunks(num_bytes, chunk_bytes):
            _broadcast(group, buf[a:b], 0, CHILD_TIMEOUT_S)
        _broadcast(group, flag, 1, CHILD_TIMEOUT_S)  # all received


def _send_runs(group: Any, num_bytes: int, chunk_bytes: int, repeats: int, timeout_s: float) -> tuple[float, ...]:
    src = _touched(num_bytes, 9)
    flag = torch.zeros(1, dtype=torch.uint8)
    spans = _chunks(num_bytes, chunk_bytes)

    def run() -> float:
        _broadcast(group, flag, 0, timeout_s)
        t0 = time.perf_counter()
        for a, b in spans:
            _broadcast(group, src[a:b], 0, timeout_s)
        _broadcast(group, flag, 1, timeout_s)
        return time.perf_counter() - t0

    return _best_of(repeats, run)


def measure_gloo(num_bytes: int, chunk_bytes: int, *, repeats: int = 3, timeout_s: float = CHILD_TIMEOUT_S) -> Limit:
    """Raw gloo broadcasts of `num_bytes` from this process to a second one, chunk by chunk."""
    repeats = max(1, repeats)
    with tempfile.TemporaryDirectory(prefix="weightsync-limit-") as tmp:
        store_path = str(Path(tmp) / "store")
        with _receiver("gloo", store_path, num_bytes, chunk_bytes, repeats):
            runs = _send_runs(_gloo_group(store_path, 0, timeout_s), num_bytes, chunk_bytes, repeats, timeout_s)
    return Limit(name="gloo", num_bytes=num_bytes, chunk_bytes=chunk_bytes, runs=runs)


def _tcp_receiver(num_bytes: int, repeats: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        server.settimeout(CHILD_TIMEOUT_S)
        sock, _ = server.accept()
        with sock:
            sock.settimeout(CHILD_TIMEOUT_S)
            buf = memoryview(bytearray(num_bytes))
            for _ in range(repeats):
                got = 0
                while got < num_bytes:
                    n = sock.recv_into(buf[got:], num_bytes - got)
                    if n == 0:
                        return
                    got += n
                sock.sendall(b"k")


def measure_tcp(num_bytes: int, chunk_bytes: int, *, repeats: int = 3, timeout_s: float = CHILD_TIMEOUT_S) -> Limit:
    """`num_bytes` over a loopback TCP socket to a second process, chunk by chunk."""
    repeats = max(1, repeats)
    with _receiver("tcp", num_bytes, repeats, stdout=subprocess.PIPE) as child:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the tcp limit's receiver did not start (said {line!r})")
        data = memoryview(_touched(num_bytes, 4).numpy().data)
        spans = _chunks(num_bytes, chunk_bytes)
        with socket.create_connection(("127.0.0.1", int(line)), timeout=timeout_s) as sock:

            def run() -> float:
                t0 = time.perf_counter()
                for a, b in spans:
                    sock.sendall(data[a:b])
                if sock.recv(1) != b"k":
                    raise ConnectionError("the tcp limit's receiver went away")
                return time.perf_counter() - t0

            runs = _best_of(repeats, run)
    return Limit(name="tcp", num_bytes=num_bytes, chunk_bytes=chunk_bytes, runs=runs)


def measure_limits(num_bytes: int, chunk_bytes: int, *, directory: Path, repeats: int = 3,
                   names: tuple[str, ...] = LIMIT_NAMES) -> dict[str, Limit]:
    """Every limit in `names` for `num_bytes` in `chunk_bytes` chunks."""
    out: dict[str, Limit] = {}
    for name in names:
        if name == "copy":  # in-process and cheap: more runs to beat a noisy machine
            out[name] = measure_copy(num_bytes, chunk_bytes, repeats=max(repeats, IN_PROCESS_REPEATS))
        elif name == "xxh3":
            out[name] = measure_xxh3(num_bytes, chunk_bytes, repeats=max(repeats, IN_PROCESS_REPEATS))
        elif name == "wsmix64":
            out[name] = measure_wsmix64(num_bytes, chunk_bytes, repeats=max(repeats, IN_PROCESS_REPEATS))
        elif name == "gloo":
            out[name] = measure_gloo(num_bytes, chunk_bytes, repeats=repeats)
        elif name == "tcp":
            out[name] = measure_tcp(num_bytes, chunk_bytes, repeats=repeats)
        elif name == "disk":
            out[name] = measure_disk(num_bytes, chunk_bytes, directory, repeats=1)
        else:
            raise ValueError(f"unknown limit {name!r}; one of {LIMIT_NAMES}")
    return out


def _child_main(argv: list[str]) -> int:
    """The receiving side: `gloo STORE NUM_BYTES CHUNK_BYTES REPEATS` or `tcp NUM_BYTES REPEATS`."""
    torch.set_num_threads(1)
    if argv[0] == "gloo":
        _gloo_receiver(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    elif argv[0] == "tcp":
        _tcp_receiver(int(argv[1]), int(argv[2]))
    else:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
