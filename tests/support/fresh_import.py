"""What a fresh interpreter imports for `import weightsync` and for `python -m weightsync --help`,
and then what glibc keeps of freed layers with and without `process_memory.heap_given_back` and
`trimmed_between`
(its thresholds are process-wide and set for good, hence a fresh process): run once per pytest
session and shared by the tests that check it (each fresh interpreter costs seconds of torch
imports)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import weightsync

SRC = Path(weightsync.__file__).parent.parent

_CODE = """
import contextlib, io, json, runpy, sys
import torch
with_torch = set(sys.modules)
import weightsync
after_import = sorted(sys.modules)
out = io.StringIO()
sys.argv = ["weightsync", "--help"]
code = None
with contextlib.redirect_stdout(out):
    try:
        runpy.run_module("weightsync", run_name="__main__", alter_sys=True)  # what `python -m` runs
    except SystemExit as e:
        code = e.code
modules = {"after_import": after_import, "added_by_weightsync": sorted(set(sys.modules) - with_torch),
           "after_help": sorted(sys.modules), "help": out.getvalue(), "help_exit": code}
from weightsync.process_memory import heap_given_back, resident_bytes, trim_heap, trimmed_between
MIB = 1 << 20
freed = torch.ones(32 * MIB, dtype=torch.uint8); del freed  # glibc raises its mmap threshold to 32 MiB
def held_after_layers():
    base = resident_bytes()
    for i in range(8):  # layer after layer, each freed before the next (vLLM's reload)
        layer = torch.ones((6 + i % 3) * MIB, dtype=torch.uint8)
        del layer
    return resident_bytes() - base
outside = held_after_layers()
with heap_given_back():
    inside = held_after_layers()
kept = []
def layers():  # each makes 16 pieces and frees every other one: freed memory between pieces in use
    for i in range(8):  # each layer's pieces larger than the last's (96-208 KiB, under the 256 KiB
        pieces = [torch.ones((96 + 16 * i) << 10, dtype=torch.uint8) for _ in range(16)]  # threshold):
        kept.extend(pieces[1::2])  # no hole an earlier layer left is reused
        del pieces
        yield
def most_held(passes):  # the most resident bytes beyond the start, less the pieces kept meanwhile
    trim_heap()
    base, already = resident_bytes(), len(kept)
    return max(resident_bytes() - base - sum(t.numel() for t in kept[already:]) for _ in passes)
with heap_given_back():
    scattered = [most_held(layers()), most_held(trimmed_between(layers(), lambda _: 3 << 20, every_bytes=3 << 20))]
print(json.dumps({**modules, "heap_kept": [outside, inside], "heap_scattered": scattered}))
"""


@dataclass(frozen=True)
class FreshImport:
    after_import: list[str]
    """sys.modules after `import torch; import weightsync`."""
    added_by_weightsync: list[str]
    """What `import weightsync` and `python -m weightsync --help` add after `import torch`."""
    after_help: list[str]
    """sys.modules after `python -m weightsync --help` ran too."""
    help: str
    """What `--help` printed."""
    help_exit: int | str | None
    """Its SystemExit code (argparse's --help: 0)."""
    heap_kept: list[int]
    """Resident bytes left after eight 6-8 MiB tensors were made and freed one after the other, once
    glibc raised its mmap threshold: outside `heap_given_back`, then inside it."""
    heap_scattered: list[int]
    """Inside `heap_given_back`, the most resident bytes beyond the start (less the pieces kept)
    while eight layers each freed eight pieces of 96-208 KiB between the pieces they keep (9.5 MiB
    in all): taken plainly, then through `trimmed_between`."""


@functools.cache
def fresh_import() -> FreshImport:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return FreshImport(**json.loads(done.stdout.splitlines()[-1]))
