"""Shared-memory slots: visible across mappings, names confined, cleaned up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weightsync.shmem import SHM_DIR, SharedSlots, check_name


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
