"""What a process's memory is, as Linux reports it: its resident set now and at its peak (VmRSS,
VmHWM of /proc/self/status; `reset_peak` sets the peak back), its proportional set size (Pss,
/proc/PID/smaps_rollup), what the host can still give it (`host_available_bytes`), and
`MemoryMark`, the peak and kept bytes of something from its start (an update's ack figures,
docs/PROTOCOL.md). Where /proc is missing or refuses, every reader answers None: no figure is
ever made up. No weightsync imports.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

_KIB = 1024


def _kib_field(path: str, field: str) -> int | None:
    """A "FIELD:  N kB" line of a /proc file (a node's meminfo prefixes it with "Node N "), in
    bytes; None where it cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    match = re.search(rf"^(?:Node \d+ )?{field}:\s+(\d+) kB", text, re.MULTILINE)
    return None if match is None else int(match.group(1)) * _KIB


def _node_list(text: str) -> set[int]:
    """The nodes of a kernel list such as "0-1,3"."""
    nodes: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            nodes.update(range(int(first), int(last or first) + 1))
    return nodes


def host_available_bytes(*, proc: str = "/proc", nodes_dir: str = "/sys/devices/system/node") -> int | None:
    """The bytes this host can still give this process without swapping: MemAvailable of
    /proc/meminfo, or where the process's cpuset allows fewer NUMA nodes than are online
    (Mems_allowed_list of /proc/self/status), the MemFree of those nodes if lower (a node
    reports no MemAvailable; its MemFree leaves out the reclaimable page cache, so it errs low).
    None without /proc/meminfo. `proc`, `nodes_dir`: where to read them (tests)."""
    available = _kib_field(f"{proc}/meminfo", "MemAvailable")
    if available is None:
        return None
    try:
        with open(f"{proc}/self/status") as f:
            match = re.search(r"^Mems_allowed_list:\s*(\S+)", f.read(), re.MULTILINE)
        with open(f"{nodes_dir}/online") as f:
            online = _node_list(f.read())
    except (OSError, ValueError):
        return available
    allowed = _node_list(match.group(1)) & online if match is not None else online
    if not allowed or allowed == online:
        return available
    free = [_kib_field(f"{nodes_dir}/node{node}/meminfo", "MemFree") for node in sorted(allowed)]
    if any(f is None for f in free):
        return available
    return min(available, sum(f for f in free if f is not None))


def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A "kB" field of /proc/PID/status (VmRSS, VmHWM, ...) in bytes; None where it cannot be read."""
    return _kib_field(f"/proc/{pid}/status", field)


def resident_bytes() -> int | None:
    """This process's resident set now (VmRSS), or None."""
    return status_bytes("VmRSS")


def peak_resident_bytes() -> int | None:
    """This process's largest resident set since it started or since the last `reset_peak` (VmHWM), or None."""
    return status_bytes("VmHWM")


def reset_peak() -> bool:
    """Set the kernel's peak mark of this process (VmHWM) back to its resident set now (Linux 4.0
    and later: "5" into /proc/self/clear_refs). The mark is the whole process's: whoever resets it
    resets it for every other reader in the process too. False where it could not be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def pss_bytes(pid: int) -> int | None:
    """Process `pid`'s proportional set size (Pss in /proc/PID/smaps_rollup) in bytes; None where it
    cannot be read (no such process, not Linux, not permitted)."""
    return _kib_field(f"/proc/{pid}/smaps_rollup", "Pss")


@dataclass(frozen=True, kw_only=True)
class MemoryMark:
    """This process's resident set at the start of something, with the peak mark reset there."""

    start_bytes: int
    """The resident set (VmRSS) right after the peak mark was reset."""

    @classmethod
    def take(cls) -> MemoryMark | None:
        """Reset the peak mark and note the resident set; None where either cannot be done."""
        if not reset_peak():
            return None
        start = resident_bytes()
        return None if start is None else cls(start_bytes=start)

    def since(self) -> tuple[int, int] | None:
        """(peak bytes beyond the start, bytes kept beyond it now) since the mark was taken; None
        where /proc cannot be read any more. The peak is never below 0 (the start was a moment of
        it); what is kept is negative where the process holds less than at the start. Another
        `reset_peak` in this process meanwhile lowers the peak to what followed it."""
        peak, now = peak_resident_bytes(), resident_bytes()
        if peak is None or now is None:
            return None
        return max(0, max(peak, now) - self.start_bytes), now - self.start_bytes


__all__ = [
    "MemoryMark",
    "heap_given_back",
    "host_available_bytes",
    "peak_resident_bytes",
    "pss_bytes",
    "reset_peak",
    "resident_bytes",
    "status_bytes",
    "trim_heap",
    "trimmed_between",
]


M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's `mallopt` parameters (malloc.h)."""
STEADY_MMAP_THRESHOLD = 32 << 20
STEADY_TRIM_THRESHOLD = 64 << 20
"""Where glibc's own dynamic thresholds end up in a process that frees large buffers (its
DEFAULT_MMAP_THRESHOLD_MAX, and twice that for trimming): what `heap_given_back` leaves set."""


@contextmanager
def heap_given_back(mmap_bytes: int = 256 << 10) -> Iterator[None]:
    """While inside, glibc maps every allocation of `mmap_bytes` or more on its own and unmaps
    it when freed, and trims the heap's free top at once: a pass that allocates and frees
    layer after layer (vLLM's reload) then holds the layer in hand, not up to 64 MiB of freed
    ones the heap keeps. Afterwards the thresholds are glibc's steady values (`STEADY_*`:
    setting them ends glibc's dynamic adjustment for good). Nothing happens without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, mmap_bytes)
    libc.mallopt(M_TRIM_THRESHOLD, mmap_bytes)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, STEADY_TRIM_THRESHOLD)
        libc.malloc_trim(0)


def trim_heap() -> bool:
    """Give the allocator's free memory back to the system (glibc's `malloc_trim(0)`): freed
    buffers of up to 32 MiB come from the heap, and glibc keeps up to twice the largest one
    freed before trimming, so a process that let go of its buckets still holds them. False
    where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.malloc_trim(0))


T = TypeVar("T")

TRIM_EVERY_BYTES = 4 << 20
"""How many bytes of items `trimmed_between` lets through between two trims by default."""


def trimmed_between(items: Iterable[T], weigh: Callable[[T], int], *,
                    every_bytes: int = TRIM_EVERY_BYTES) -> Iterator[T]:
    """`items`, with the allocator's free memory given back (`trim_heap`) before the next is
    taken once those taken since the last trim weigh `every_bytes` (`weigh(item)`: its bytes).
    For a pass that frees part of what it made for the items before it takes the next (vLLM's
    reload: a layer's new tensors and kernel handles, made when its last weight arrives): what
    it frees below memory still in use stays resident, since glibc's own trimming returns the
    free top of a heap only, so a reload of every layer otherwise holds a little of each until
    it ends (42 MiB per worker on a 199 MiB model at TP=2). A trim costs about 0.15 ms on a
    300 MiB heap; by weight, a model of many small tensors pays no more trims than one of
    few large ones."""
    taken = 0
    for item in items:
        if taken >= every_bytes:
            trim_heap()
            taken = 0
        taken += weigh(item)
        yield item
