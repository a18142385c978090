"""Shared-memory slots: visible across mappings, names confined, cleaned up."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from weightsync.transports.shmem import SHM_DIR, SharedSlots, check_name


def test_slots_are_shared_between_mappings_and_removed_on_close() -> None:
    owner = SharedSlots.create(slot_bytes=32, num_slots=2)
    try:
        owner.slot(1, 4).copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
        reader = SharedSlots.open(owner.name, slot_bytes=32, num_slots=2)
        assert reader.slot(1, 4).tolist() == [1, 2, 3, 4]
        assert reader.slot(0).numel() == 32
        with pytest.raises(ValueError, match="out of range"):
            reader.slot(2)
        with pytest.raises(ValueError, match="do not fit"):
            reader.slot(0, 33)
        reader.close()
        assert Path(SHM_DIR / owner.name).exists(), "a reader never removes the segment"
    finally:
        owner.close()
    assert not Path(SHM_DIR / owner.name).exists()
    owner.close()  # idempotent


@pytest.mark.parametrize("name", ["../etc/passwd", "psm_123", "weightsync-../x", "", "weightsync-" + "a" * 65])
def test_names_outside_the_namespace_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="must match"):
        check_name(name)


def test_opening_a_missing_segment_says_so() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SharedSlots.open("weightsync-nosuchsegment", slot_bytes=8, num_slots=2)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (as a container's default /dev/shm is 64 MiB), mounted for this test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI and the dev machines run as root)")
    mount = tmp_path / "shm"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_segment_larger_than_dev_shm_is_refused_by_name(small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Allocated at creation: a sparse segment past the tmpfs's room would SIGBUS the trainer mid-bucket."""
    monkeypatch.setattr("weightsync.transports.shmem.SHM_DIR", small_tmpfs)
    with pytest.raises(OSError, match=r"needs 4194304 \(2 slots of 2097152 bytes.*lower bucket_bytes") as info:
        SharedSlots.create(slot_bytes=2 << 20, num_slots=2)
    assert info.value.errno == errno.ENOSPC
    assert list(small_tmpfs.iterdir()) == [], "the refused segment is removed"
    fits = SharedSlots.create(slot_bytes=256 << 10, num_slots=2)  # 512 KiB: fits, and every byte is writable
    try:
        fits.slot(1).fill_(7)
        assert int(fits.slot(1).sum()) == 7 * (256 << 10)
    finally:
        fits.close()
