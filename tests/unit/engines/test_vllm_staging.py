"""The staging segment a vLLM engine's workers share on their host (`engines.vllm.staging`): one
segment per update found by every worker under one name, written by any, gone when they close;
a killed engine's segment is an orphan the next segment made on the host removes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from weightsync.bucketing import plan_buckets
from weightsync.engines.vllm.staging import ALIGN_BYTES, HostStaging, staging_name
from weightsync.manifest import Manifest, TensorMeta
from weightsync.owners import owner_tag
from weightsync.transports.shmem import SHM_DIR, SharedSlots

WEIGHTS = {f"w{i}": torch.zeros(300 + i, dtype=torch.float32) for i in range(5)}


def manifest(version: int) -> Manifest:
    return Manifest(version=version, buckets=plan_buckets([TensorMeta.of(n, t) for n, t in WEIGHTS.items()], 2048))


def test_two_workers_of_one_engine_map_one_segment_that_goes_when_both_close() -> None:
    m = manifest(3)
    name = staging_name("engine-a", m, engine_pid=os.getppid())
    assert name != staging_name("engine-b", m, engine_pid=os.getppid()), "another engine, another segment"
    assert name != staging_name("engine-a", manifest(4), engine_pid=os.getppid()), "another update, another one"
    first = HostStaging.join(name, m)
    second = HostStaging.join(name, m)
    try:
        assert (first.created, second.created) == (True, False)
        assert first.nbytes == sum(-(-b.nbytes // ALIGN_BYTES) * ALIGN_BYTES for b in m.buckets) == second.nbytes
        assert len(m.buckets) > 1 and all(o % ALIGN_BYTES == 0 for o in first.offsets)
        second.bucket(1).fill_(7)  # written by one worker, read by the other
        assert first.bucket(1).numel() == m.buckets[1].nbytes and bool((first.bucket(1) == 7).all())
        assert not bool((first.bucket(0) == 7).any())
        assert not list(SHM_DIR.glob(f"weightsync-{owner_tag()}-*")), "no half-made segment left"
        view = second.bucket(1)
        first.close()
        assert not (SHM_DIR / name).exists(), "the first worker to close removes the name"
        second.close()
        second.close()  # idempotent
        assert int(view[0]) == 7, "a view kept (a sparse base) keeps its pages"
    finally:
        first.close()
        second.close()


def test_a_killed_engines_segment_is_removed_by_the_next_segment_made_on_the_host() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    name = staging_name("engine-c", manifest(1), engine_pid=int(dead.stdout))
    left = HostStaging.join(name, manifest(1))
    left._remove.detach()  # as a killed engine: nothing removes it
    left._tensor = None
    assert (SHM_DIR / name).exists()
    SharedSlots.create(slot_bytes=8).close()
    assert not (SHM_DIR / name).exists()


def test_a_dev_shm_without_room_refuses_the_update_naming_the_bytes_and_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from weightsync.errors import StagingMemoryError

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "no space")

    monkeypatch.setattr(os, "posix_fallocate", full)
    m = manifest(2)
    name = staging_name("engine-d", m, engine_pid=os.getppid())
    with pytest.raises(StagingMemoryError, match=r"needs \d+; give /dev/shm more room .*--shm-size"):
        HostStaging.join(name, m)
    assert not (SHM_DIR / name).exists() and not list(SHM_DIR.glob(f"weightsync-{owner_tag()}-*"))
