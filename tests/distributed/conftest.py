"""Spawn gloo process groups for distributed tests.

`run_distributed(fn, world_size, *args)` runs `fn(rank, world_size, init_file,
*args)` in `world_size` spawned processes that rendezvous through a
`file://` store in pytest's tmp_path (no ports, no sleeps) and re-raises the
first failure with the child's traceback. `fn` must be a module-level function
(spawned children import it by name) and must call `dist_util.init_gloo` itself. Each
child runs `dist_util.spawned_rank`, which lives in a module of a unique name: pytest
imports every conftest.py as a module named "conftest", and whichever was imported last
holds that name, so a spawned child looked up by "conftest" could find another one's.

Ranks are forked from a fork server (multiprocessing's "forkserver" start method) that
imported torch, transformers, peft, weightsync and these test modules once for the whole
session: a spawned interpreter spent about 6 s of CPU importing them, for every rank of
every test. The server only imports (no tensor op, so no OpenMP pool is forked); each
rank still starts from a clean process image that no test has touched.

A rank ends with `os._exit`, not by running the interpreter's shutdown. Under
FSDP2 the gloo process group outlives `destroy_process_group()` (FSDP's state
keeps it alive), so its C++ worker threads are still there while Python shuts
down. A worker that drops the last reference to a Python-owned tensor then takes
the GIL of a finalizing interpreter and the rank dies with SIGABRT ("terminate
called without an active exception"). Plain torch does this with no weightsync
code at all: 5 of 40 runs of a 2-rank FSDP2 script on this machine under CPU
load, 0 of 40 with `os._exit` (CONTRIBUTING.md, "Distributed tests").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from dist_util import init_gloo, spawned_rank

__all__ = ["init_gloo"]  # kept for tests that import it from here; prefer dist_util


PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.tensor", "transformers", "peft",
           "safetensors.torch", "weightsync", "weightsync.tiny", "weightsync.sources.fsdp", "dist_util",
           *sorted(p.stem for p in Path(__file__).parent.glob("test_*.py"))]
"""What the fork server imports once (by module name; the test modules are on sys.path)."""


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the fork server in the background once the tests are collected, if any of them
    is here (it imports for about 15 s; tests/unit runs first meanwhile)."""
    here = Path(__file__).parent
    if not session.config.option.collectonly and any(item.path.is_relative_to(here) for item in session.items):
        threading.Thread(target=_start_fork_server, daemon=True, name="dist-forkserver").start()


def _start_fork_server() -> None:
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()  # a rank started meanwhile waits for it (the module's lock)


@pytest.fixture
def run_distributed(tmp_path: Path) -> Callable[..., None]:
    def run(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
        init_file = str(tmp_path / "rendezvous")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first run)
        errors = ctx.SimpleQueue()
        ctx_procs = mp.start_processes(
            spawned_rank, args=(fn, world_size, init_file, args, errors), nprocs=world_size,
            join=False, start_method="forkserver",
        )
        try:
            while not ctx_procs.join(timeout=300):
                pass
        except mp.ProcessRaisedException:
            pass
        except mp.ProcessExitedException as e:
            if errors.empty():
                raise AssertionError(f"a rank died: {e}") from None
        if not errors.empty():
            rank, tb = errors.get()
            raise AssertionError(f"rank {rank} failed:\n{tb}")

    return run
