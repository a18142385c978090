"""Transports: how packed buckets move from the trainer to the engines."""

from __future__ import annotations

from pathlib import Path

from weightsync.transports.base import Transport
from weightsync.transports.broadcast import BroadcastTransport
from weightsync.transports.disk import DiskTransport
from weightsync.transports.http import HttpTransport
from weightsync.transports.shm import ShmTransport

TRANSPORTS = ("disk", "http", "broadcast", "shm")


def make_transport(
    name: str,
    *,
    timeout_s: float = 60.0,
    disk_root: str | Path | None = None,
    keep_versions: int = 2,
    master_address: str = "127.0.0.1",
    backend: str | None = None,
) -> Transport:
    """The trainer-side transport called `name`."""
    if name == "http":
        return HttpTransport(timeout_s=timeout_s)
    if name == "shm":
        return ShmTransport(timeout_s=timeout_s)
    if name == "broadcast":
        return BroadcastTransport(master_address=master_address, backend=backend, timeout_s=timeout_s)
    if name == "disk":
        if disk_root is None:
            raise ValueError("transport='disk' needs disk_root: a directory the engines can read")
        return DiskTransport(disk_root, keep_versions=keep_versions, timeout_s=timeout_s)
    raise ValueError(f"unknown transport {name!r}; one of {TRANSPORTS}")


__all__ = ["TRANSPORTS", "BroadcastTransport", "DiskTransport", "HttpTransport", "ShmTransport",
           "Transport", "make_transport"]
