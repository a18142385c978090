"""Disk transport: each bucket written as a safetensors file into a temporary
directory, fsynced, then the directory renamed into place as `<root>/v%08d`
with its manifest.json (`DiskTransport`; the format is `weightsync.formats.version_dir`).

Engines load the whole version at commit (`DiskReceiver.read` where weightsync
stages it, SGLang's (`update_weights_from_disk` elsewhere, a PEFT directory
for LoRA). The last `keep_versions` versions stay on disk; older ones
are deleted after each publish. Needs a filesystem the engines can read.

The temporary directory is named after its writer (`weightsync.owners`), so
one left by a killed trainer is removed the next time a trainer on the same
host opens the root.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import secrets
import shutil
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from weightsync.errors import IntegrityError, WeightSyncError
from weightsync.formats.version_dir import Place, no_place, publish, read_announced, write_bucket, write_manifest
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta, Manifest
from weightsync.owners import TAG_PATTERN, orphans, owner_tag
from weightsync.reports import Ack
from weightsync.transports.base import Receiver, ReceiverDefaults, SlotBuffers, typed

log = logging.getLogger(__name__)

LORA_WEIGHTS_FILE = "adapter_model.safetensors"
LORA_CONFIG_FILE = "adapter_config.json"
_VERSION_DIR = re.compile(r"^v(\d{8})$")
_TEMP_DIR = re.compile(rf"^\.tmp-v\d{{8}}-({TAG_PATTERN})-[0-9a-f]{{8}}$")


class DiskTransportError(WeightSyncError, OSError):
    """Writing a version failed (disk full, file too large, a path that is not a writable
    directory). Also an OSError, with the original errno."""


@contextlib.contextmanager
def _writing(what: str, path: Path) -> Iterator[None]:
    """Turn an OSError while writing `path` into a DiskTransportError naming it."""
    try:
        yield
    except OSError as e:
        raise DiskTransportError(
            e.errno, f"disk transport: {what} {path} failed: {e.strerror or e} "
            "(is the disk full, or the directory not writable?)") from e


@dataclass(frozen=True, kw_only=True)
class DiskLink(Link, transport="disk"):
    """A directory of published versions, readable by the engines."""

    root: str
    """Directory holding `v<version>/` checkpoints."""

    def version_dir(self, version: int) -> str:
        """The final directory of `version`."""
        return f"{self.root}/v{version:08d}"


class DiskReceiver(ReceiverDefaults):
    """Reads a published version directory at commit; nothing per bucket."""

    reads_at_commit: ClassVar[bool] = True

    def __init__(self, *, max_sessions: int = 1, device: torch.device | None = None) -> None:
        return None

    def fetch(self, link: Link, bucket: BucketMeta, delivery: Delivery, into: torch.Tensor) -> torch.Tensor:
        raise ValueError("the disk transport delivers nothing per bucket; the version is read at commit")

    def read(self, link: Link, manifest: Manifest, place: Place = no_place) -> Iterator[tuple[int, torch.Tensor]]:
        """Every bucket of `manifest`'s version directory, checked against `manifest`, each read
        into `place(bucket)` where that gives one (a LoRA adapter: its adapter_model.safetensors,
        one bucket, read on its own)."""
        directory = Path(typed(link, DiskLink).version_dir(manifest.version))
        if manifest.is_adapter:
            yield 0, _read_adapter_bucket(directory / LORA_WEIGHTS_FILE, manifest.buckets[0])
            return
        for bucket, buffer in read_announced(directory, manifest, place):  # each digest verified against manifest.json
            yield bucket.index, buffer
            del buffer  # the next bucket is read without this one held (a streamed update let it go)


class DiskTransport:
    """Version directories under `root`, published atomically."""

    name: ClassVar[str] = "disk"
    receiver: ClassVar[type[Receiver]] = DiskReceiver
    per_bucket_delivery: ClassVar[bool] = False
    adapter_in_one_bucket: ClassVar[bool] = True
    survives_failure: ClassVar[bool] = True
    same_host_only: ClassVar[bool] = False
    relays: ClassVar[bool] = False
    trainer_address: ClassVar[str | None] = None

    @property
    def buffer_device(self) -> torch.device:
        return torch.device("cpu")

    def __init__(self, root: str | Path, *, keep_versions: int = 2, timeout_s: float = 60.0) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be at least 1, got {keep_versions}")
        self.root = Path(root)
        self.keep_versions = keep_versions
        self.timeout_s = timeout_s
        self._slots = SlotBuffers()
        self._tmp: Path | None = None
        self._lora = False

    def open(self, engine_ranks: Sequence[int], *, max_bucket_bytes: int, leased_buckets: int = 0) -> list[Link]:
        with _writing("creating the root directory", self.root):
            self.root.mkdir(parents=True, exist_ok=True)
        _remove_orphans(self.root)
        return [DiskLink(transport=self.name, root=str(self.root), timeout_s=self.timeout_s) for _ in engine_ranks]

    def establish(self) -> None:
        return None

    def begin(self, manifest: Manifest) -> None:
        """Start writing a version (a PEFT adapter directory in "lora" mode)."""
        self.discard(manifest.version)
        self._tmp = self.root / f".tmp-v{manifest.version:08d}-{owner_tag()}-{secrets.token_hex(4)}"
        with _writing("creating", self._tmp):
            self._tmp.mkdir()
        self._lora = manifest.is_adapter
        if self._lora and len(manifest.buckets) != 1:
            raise ValueError("a LoRA adapter goes to disk as one bucket; raise bucket_bytes")

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        return self._slots.get(index, nbytes)

    def deliver(self, bucket: BucketMeta, buffer: torch.Tensor) -> Delivery:
        assert self._tmp is not None, "begin() first"
        with _writing(f"writing bucket {bucket.index} into", self._tmp):
            path = write_bucket(self._tmp, bucket, buffer)
            if self._lora:
                path.rename(self._tmp / LORA_WEIGHTS_FILE)
        return Delivery(transport=self.name)

    def send(self, bucket: BucketMeta, buffer: torch.Tensor) -> None:
        return None

    def finish(self, manifest: Manifest) -> None:
        assert self._tmp is not None, "begin() first"
        final = self.root / f"v{manifest.version:08d}"
        with _writing("publishing", final):
            if manifest.is_adapter:
                _write_json(self._tmp / LORA_CONFIG_FILE, dict(manifest.lora_config or {}))
            write_manifest(self._tmp, manifest)
            if final.exists():  # a re-push of the same version replaces it
                shutil.rmtree(final)
            publish(self._tmp, final)
        self._tmp = None
        self._prune(final)

    def committed(self, acks: Sequence[Ack]) -> None:
        return None

    def discard(self, version: int) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def close(self) -> None:
        self.discard(-1)
        self._slots.clear()

    def _prune(self, published: Path) -> None:
        """Keep `published` and the `keep_versions - 1` versions just below it.

        Versions above it can only be left over from an earlier run (versions
        never go backwards within one): they go too, never the one just published.
        """
        others = sorted(p for p in self.root.iterdir() if _VERSION_DIR.match(p.name) and p != published)
        older = [p for p in others if p.name < published.name]
        kept = set(older[len(older) - (self.keep_versions - 1):]) if self.keep_versions > 1 else set()
        for old in others:
            if old not in kept:
                log.debug("removing version %s", old)
                shutil.rmtree(old, ignore_errors=True)


def _remove_orphans(root: Path) -> None:
    """Remove the temporary directories of trainers on this host that died mid-write."""
    for path in orphans(root.iterdir(), _TEMP_DIR):
        log.info("removing %s, left by a trainer that is gone", path)
        shutil.rmtree(path, ignore_errors=True)


def _read_adapter_bucket(path: Path, bucket: BucketMeta) -> torch.Tensor:
    """The data section of an adapter_model.safetensors, checked against the
    manifest's entries (its digest is checked when it is staged)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        for entry in bucket.entries:
            got = header.get(entry.hf_name) or {}
            if got.get("data_offsets") != [entry.offset, entry.offset + entry.nbytes] or \
                    got.get("shape") != list(entry.shape):
                raise IntegrityError(f"{path}: entry {entry.hf_name!r} does not match the manifest")
        data = bytearray(f.read(bucket.nbytes + 1))  # one byte more: a longer file fails the size check
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    import os

    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
