"""Helpers for spawned gloo ranks (a module with a unique name, importable from
the spawned children and from test modules)."""

from __future__ import annotations

import torch.distributed as dist


def init_gloo(rank: int, world_size: int, init_file: str) -> None:
    """Join the test's default gloo group through a `file://` store (no ports)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
