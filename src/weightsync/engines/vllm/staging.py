"""The staging area the tensor-parallel workers of one vLLM engine share on their host: one
/dev/shm segment per update, a page-aligned region per bucket, made (allocated once) by the first
worker that begins the update and mapped by the others (`HostStaging.join`). Every worker lands
each bucket in it (the same bytes; each checks the digest of what it wrote) and reloads only its
shard from it, so the host holds one staged copy however many ranks it runs. Every worker removes
the segment's name when the update ends; one left by an engine that was killed is removed by the
next segment made on the host (`transports.shmem.remove_orphans`: it is named after the engine's
process). The design: docs/VLLM.md, "Staging".
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import time
import weakref
from pathlib import Path

import torch

from weightsync.errors import StagingMemoryError
from weightsync.manifest import Manifest
from weightsync.owners import owner_tag
from weightsync.transports.shmem import NAME_PREFIX, SHM_DIR, check_name, remove_orphans

ALIGN_BYTES = 4096
"""Each bucket's region starts on a page."""
WAIT_S = 120.0
"""How long a worker waits for another to finish allocating the segment."""


def staging_name(engine_key: str, manifest: Manifest, *, engine_pid: int) -> str:
    """The segment's name for `manifest` in the engine `engine_key` (what every worker of one engine
    shares: vLLM's `instance_id`), named after the engine's process `engine_pid` (the workers' parent),
    so that a segment it leaves when killed is an orphan of a dead owner."""
    layout = ",".join(str(b.nbytes) for b in manifest.buckets)
    key = f"{engine_key}\0{manifest.version}\0{manifest.owner}\0{manifest.mode}\0{layout}"
    return check_name(f"{NAME_PREFIX}{owner_tag(engine_pid)}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


class HostStaging:
    """One update's staging segment, mapped by this worker (see the module docstring)."""

    def __init__(self, path: Path, manifest: Manifest, *, created: bool) -> None:
        self.path = path
        self.created = created
        """This worker made the segment (its ack counts the segment; the others' do not)."""
        self.offsets: list[int] = []
        end = 0
        for bucket in manifest.buckets:
            self.offsets.append(end)
            end += -(-bucket.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        self.nbytes = max(1, end)
        self._sizes = [b.nbytes for b in manifest.buckets]
        actual = path.stat().st_size
        if actual != self.nbytes:
            raise ValueError(f"staging segment {path.name} has {actual} bytes, update v{manifest.version} needs "
                             f"{self.nbytes}")
        self._tensor: torch.Tensor | None = torch.from_file(str(path), shared=True, size=self.nbytes,
                                                            dtype=torch.uint8)
        self.base_ptr = self._tensor.untyped_storage().data_ptr()
        """Where this worker mapped it: a tensor whose storage starts here views the segment."""
        self._remove = weakref.finalize(self, _unlink, path)  # at exit too; a killed engine's: an orphan

    @classmethod
    def join(cls, name: str, manifest: Manifest, *, wait_s: float = WAIT_S) -> HostStaging:
        """Map the segment `name` for `manifest`, making it first if no worker has (created under its
        name, then allocated whole: tmpfs sets its size once every page is allocated, so a worker
        that finds it maps it once it has its full size). `StagingMemoryError` where /dev/shm has
        no room for it; TimeoutError where the worker making it stopped halfway for `wait_s`."""
        path = SHM_DIR / check_name(name)
        nbytes = cls.size_of(manifest)
        remove_orphans()
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:  # another worker makes it, or made it
                try:
                    size = path.stat().st_size
                except FileNotFoundError:  # its maker gave up (no room): try to make it here
                    continue
                if size == nbytes:
                    return cls(path, manifest, created=False)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"staging segment {name} stayed at {size} of {nbytes} bytes for {wait_s:.0f} "
                                       "s: the worker making it stopped") from None
                time.sleep(0.005)
                continue
            try:
                os.posix_fallocate(fd, 0, nbytes)  # allocated now: a full tmpfs fails here, by name
            except OSError as e:
                _unlink(path)
                if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                free = shutil.disk_usage(SHM_DIR).free
                raise StagingMemoryError(
                    f"staged update v{manifest.version} refused before a byte moved: the engine's workers stage it "
                    f"once in {SHM_DIR}, which has {free} bytes free, and it needs {nbytes}; give {SHM_DIR} more "
                    "room (e.g. `docker run --shm-size`, or --ipc=host as vLLM advises), or push a smaller update",
                    needed_bytes=nbytes, available_bytes=free) from None
            finally:
                os.close(fd)
            return cls(path, manifest, created=True)

    @staticmethod
    def size_of(manifest: Manifest) -> int:
        """The segment's bytes for `manifest`: every bucket, each rounded up to a page."""
        return max(1, sum(-(-b.nbytes // ALIGN_BYTES) * ALIGN_BYTES for b in manifest.buckets))

    def bucket(self, index: int) -> torch.Tensor:
        """Bucket `index`'s region (uint8, exactly its bytes)."""
        assert self._tensor is not None, "the staging segment is closed"
        start = self.offsets[index]
        return self._tensor[start:start + self._sizes[index]]

    def close(self) -> None:
        """Drop this worker's mapping (it goes with the last view of it) and remove the name. Idempotent."""
        self._tensor = None
        self._remove()


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


__all__ = ["HostStaging", "staging_name"]
