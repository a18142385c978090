"""Leftovers of killed trainers (a disk version's `.tmp-v*` directory, a shm segment)
are removed by the next writer on the host, and only when their owner is gone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gone_owner import gone_owner
from weightsync.owners import owner_gone, owner_tag
from weightsync.transports.disk import DiskTransport
from weightsync.transports.shmem import SHM_DIR, SharedSlots


@pytest.fixture(scope="module")
def dead_tag() -> str:
    """The owner tag of a process that has exited (and been reaped)."""
    return gone_owner()[0]


def test_only_a_dead_owner_of_this_host_is_gone(dead_tag: str) -> None:
    assert dead_tag != owner_tag() and dead_tag.split("-")[0] == owner_tag().split("-")[0]
    assert owner_gone(dead_tag)
    assert not owner_gone(owner_tag())  # this process
    host = owner_tag().split("-")[0]
    assert not owner_gone(f"{host}-{os.getppid()}")  # a live process
    other_host = ("0" if host[0] != "0" else "1") + host[1:]
    assert not owner_gone(f"{other_host}-{dead_tag.split('-')[1]}")  # never judged from here
    for malformed in ("", "x", "../etc", f"{host}-", f"{host}-99999999999"):
        assert not owner_gone(malformed)


def test_disk_root_drops_only_dead_trainers_temp_dirs(tmp_path: Path, dead_tag: str) -> None:
    dead = tmp_path / f".tmp-v00000007-{dead_tag}-0123abcd"
    live = tmp_path / f".tmp-v00000008-{owner_tag()}-0123abcd"
    unknown = tmp_path / ".tmp-v00000009-0123abcd"  # not ours to judge (an older weightsync's name)
    for path in (dead, live, unknown):
        path.mkdir()
        (path / "bucket-00000.safetensors").write_bytes(b"x")
    DiskTransport(tmp_path).open([1], max_bucket_bytes=1)
    assert not dead.exists() and live.exists() and unknown.exists()


def test_creating_a_segment_drops_only_dead_creators_segments(dead_tag: str) -> None:
    dead = SHM_DIR / f"weightsync-{dead_tag}-0123456789abcdef"
    live = SHM_DIR / f"weightsync-{owner_tag()}-0123456789abcdef"
    try:
        for path in (dead, live):
            path.write_bytes(b"\0" * 16)
        slots = SharedSlots.create(slot_bytes=8)
        assert not dead.exists() and live.exists()
        assert slots.name.startswith(f"weightsync-{owner_tag()}-")
        slots.close()
    finally:
        for path in (dead, live):
            path.unlink(missing_ok=True)
