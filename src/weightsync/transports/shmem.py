"""A named shared-memory segment split into fixed-size slots (the shm transport's).

The trainer creates the segment and packs buckets straight into its slots; an
engine on the same host opens it by name and copies a slot out, or serves from
it (`transports.shm` says which slots the trainer may write when).

Segment names are confined to the "weightsync-" prefix so an engine cannot be
told to map an arbitrary segment. They carry their creator's owner tag
(`weightsync.owners`): creating a segment first removes those whose creator on
this host was killed before it could remove them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import weakref
from pathlib import Path

import torch

from weightsync.owners import TAG_PATTERN, orphans, owner_tag

NAME_PREFIX = "weightsync-"
SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"^weightsync-[A-Za-z0-9_-]{1,64}$")
_OWNED_RE = re.compile(rf"^weightsync-({TAG_PATTERN})-[0-9a-f]{{16}}$")


def check_name(name: str) -> str:
    """Refuse segment names outside the weightsync namespace."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"shared memory name {name!r} must match {_NAME_RE.pattern}")
    return name


def slot_view(buffer: torch.Tensor, index: int, nbytes: int | None, *, slot_bytes: int,
              num_slots: int) -> torch.Tensor:
    """The first `nbytes` (default all) of slot `index` of `buffer`, `num_slots` slots of `slot_bytes`
    each (a shared segment's, or the CUDA IPC buffer's: transports/cuda_ipc.py)."""
    if not 0 <= index < num_slots:
        raise ValueError(f"slot {index} out of range 0..{num_slots - 1}")
    n = slot_bytes if nbytes is None else nbytes
    if not 0 <= n <= slot_bytes:
        raise ValueError(f"{n} bytes do not fit a {slot_bytes}-byte slot")
    start = index * slot_bytes
    return buffer[start : start + n]


class SharedSlots:
    """`num_slots` slots of `slot_bytes` in one named segment, viewed as uint8 tensors.

    The segment is a file under /dev/shm mapped MAP_SHARED (`torch.from_file`),
    so no resource tracker unlinks it behind the creator's back.
    """

    def __init__(self, name: str, *, slot_bytes: int, num_slots: int, owner: bool) -> None:
        self.name = check_name(name)
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.owner = owner
        path = SHM_DIR / name
        size = slot_bytes * num_slots
        actual = path.stat().st_size
        if actual < size:
            raise ValueError(f"segment {name} has {actual} bytes, needs {size}")
        self._tensor: torch.Tensor | None = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        # The creator removes the segment even if close() is never called (at garbage
        # collection or interpreter exit); only a killed process leaves one behind.
        self._remove = weakref.finalize(self, _unlink, path) if owner else None

    @classmethod
    def create(cls, *, slot_bytes: int, num_slots: int = 2) -> SharedSlots:
        remove_orphans()
        name = f"{NAME_PREFIX}{owner_tag()}-{secrets.token_hex(8)}"
        size = max(1, slot_bytes * num_slots)
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Allocated now, not on first write: a sparse segment larger than what the tmpfs
            # has left kills the writer with SIGBUS mid-bucket; this fails here, by name.
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            _unlink(SHM_DIR / name)
            if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            free = shutil.disk_usage(SHM_DIR).free
            raise OSError(e.errno, f"{SHM_DIR} has {free} bytes free; the shm transport's segment needs {size} "
                          f"({num_slots} slots of {slot_bytes} bytes, the largest bucket): lower bucket_bytes, "
                          f"give {SHM_DIR} more room (e.g. `docker run --shm-size`), or use another transport "
                          f"(\"broadcast\", \"http\")") from None
        finally:
            os.close(fd)
        return cls(name, slot_bytes=slot_bytes, num_slots=num_slots, owner=True)

    @classmethod
    def open(cls, name: str, *, slot_bytes: int, num_slots: int) -> SharedSlots:
        if not (SHM_DIR / check_name(name)).exists():
            raise FileNotFoundError(f"shared memory segment {name!r} does not exist (is the trainer on this host?)")
        return cls(name, slot_bytes=slot_bytes, num_slots=num_slots, owner=False)

    def slot(self, index: int, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 view of slot `index` (its first `nbytes`, default all)."""
        assert self._tensor is not None, "segment is closed"
        return slot_view(self._tensor, index, nbytes, slot_bytes=self.slot_bytes, num_slots=self.num_slots)

    def close(self) -> None:
        """Drop this process's mapping (it goes with the last view) and, for the
        creator, remove the segment. Idempotent."""
        self._tensor = None
        if self._remove is not None:
            self._remove()


def remove_orphans() -> None:
    """Remove the segments whose creator on this host is gone."""
    for path in orphans(SHM_DIR.glob(f"{NAME_PREFIX}*"), _OWNED_RE):
        _unlink(path)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
