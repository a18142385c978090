"""Helpers for spawned gloo ranks (a module with a unique name, importable from
the spawned children and from test modules)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def init_gloo(rank: int, world_size: int, init_file: str) -> None:
    """Join the test's default gloo group through a `file://` store (no ports)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def spawned_rank(rank: int, fn: Callable[..., Any], world_size: int, init_file: str, args: tuple, errors: Any) -> None:
    """One spawned rank: `fn(rank, world_size, init_file, *args)`, its traceback put on
    `errors` if it raises; it ends with `os._exit` (tests/distributed/conftest.py says why)."""
    status = 0
    try:
        fn(rank, world_size, init_file, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        status = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
