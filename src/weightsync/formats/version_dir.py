"""The disk format: a version directory of one safetensors file per bucket plus manifest.json.

    <root>/v00000007/bucket-00000.safetensors ... manifest.json

Each file's data section IS the packed bucket (any safetensors reader can read it; the digest is in
its `__metadata__` and in manifest.json); a version is written under a temporary name, fsynced and
renamed, so a reader sees a whole version or none. Bytes and files only: the disk transport writes,
engines read and verify. Sparse entries and the details: docs/PROTOCOL.md.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from weightsync.digests import XXH3_64
from weightsync.errors import IntegrityError, ManifestError
from weightsync.integrity import check_bucket, digest
from weightsync.manifest import BucketMeta, Manifest, TensorMeta

MANIFEST_FILE = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.bool: "BOOL",
}


def bucket_file_name(index: int) -> str:
    return f"bucket-{index:05d}.safetensors"


def bucket_file_header(bucket: BucketMeta, digest_hex: str) -> bytes:
    """The safetensors header (length prefix + JSON, space-padded to 8 bytes)."""
    header: dict[str, object] = {
        "__metadata__": {"format": "pt", "weightsync_bucket": str(bucket.index), "weightsync_digest": digest_hex},
    }
    for e in bucket.entries:
        if e.dtype not in _ST_DTYPES:
            raise ManifestError(f"{e.hf_name!r}: dtype {e.dtype} has no safetensors code; use another transport")
        header[e.hf_name] = {
            "dtype": _ST_DTYPES[e.stored_dtype], "shape": list(e.stored_shape),
            "data_offsets": [e.offset, e.offset + e.nbytes],
        }
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bucket(directory: Path, bucket: BucketMeta, buffer: torch.Tensor) -> Path:
    """Write one bucket file (fsynced) and return its path."""
    digest_hex = bucket.digest or digest(buffer)
    path = directory / bucket_file_name(bucket.index)
    with open(path, "wb") as f:
        f.write(bucket_file_header(bucket, digest_hex))
        if buffer.numel():
            f.write(buffer.cpu().numpy().data)
        f.flush()
        os.fsync(f.fileno())
    return path


def write_manifest(directory: Path, manifest: Manifest) -> None:
    path = directory / MANIFEST_FILE
    with open(path, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(directory)


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """Atomically rename a fully written version directory into place."""
    if final_dir.exists():
        raise FileExistsError(f"{final_dir} already exists; versions are written once")
    os.rename(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_FILE
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path} is {size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
    return Manifest.from_json(path.read_bytes())


def read_bucket(directory: Path, bucket: BucketMeta, algorithm: str = XXH3_64,
                into: torch.Tensor | None = None) -> torch.Tensor:
    """Read one bucket's data section and verify it; returns a uint8 tensor: `into` (a uint8
    CPU tensor of the bucket's size, where the caller keeps a place for it) or a new one.

    The file's header must describe exactly the manifest's entries, and the
    bytes must match the manifest's digest (computed with `algorithm`, the manifest's).
    """
    path = directory / bucket_file_name(bucket.index)
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise IntegrityError(f"{path}: truncated safetensors header")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > MAX_MANIFEST_BYTES:
            raise IntegrityError(f"{path}: header of {header_len} bytes is too large")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise IntegrityError(f"{path}: malformed safetensors header: {e}") from None
        for entry in bucket.entries:
            got = header.get(entry.hf_name)
            span = [entry.offset, entry.offset + entry.nbytes]
            if not got or got.get("data_offsets") != span or got.get("shape") != list(entry.stored_shape):
                raise IntegrityError(f"{path}: entry {entry.hf_name!r} does not match the manifest")
        if len(header) - ("__metadata__" in header) != len(bucket.entries):
            raise IntegrityError(f"{path}: holds tensors the manifest does not list")
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8) if into is None else into
        if buffer.numel() != bucket.nbytes or buffer.dtype != torch.uint8:
            raise ValueError(f"bucket {bucket.index}: a place of {buffer.numel()} {buffer.dtype} for "
                             f"{bucket.nbytes} bytes")
        got = f.readinto(buffer.numpy().data.cast("B")) if bucket.nbytes else 0  # straight in: no bytes object
        if got != bucket.nbytes or f.read(1):
            size = f"{got}" if got != bucket.nbytes else f"more than {got}"
            raise IntegrityError(f"bucket {bucket.index}: {path} holds {size} data bytes, manifest says "
                                 f"{bucket.nbytes} (truncated or padded)")
    check_bucket(bucket, buffer, algorithm)
    return buffer


Place = Callable[[BucketMeta], torch.Tensor | None]
"""Where a bucket is read to, where the reader keeps a place for it (`read_bucket`'s `into`); None: a new buffer."""


def no_place(bucket: BucketMeta) -> torch.Tensor | None:
    """No place kept: every bucket read into a new buffer."""
    return None


def read_version(directory: Path,
                 place: Place = no_place) -> tuple[Manifest, Iterator[tuple[BucketMeta, torch.Tensor]]]:
    """The manifest of a version directory and its verified buckets, one at a time (each read
    into `place(bucket)` where that gives one)."""
    manifest = read_manifest(directory)
    if any(b.digest is None for b in manifest.buckets):
        raise ManifestError(f"{directory / MANIFEST_FILE}: every bucket needs a digest")

    def buckets() -> Iterator[tuple[BucketMeta, torch.Tensor]]:
        for b in manifest.buckets:
            yield b, read_bucket(directory, b, manifest.digest_algorithm, into=place(b))

    return manifest, buckets()


def read_announced(directory: Path, announced: Manifest,
                   place: Place = no_place) -> Iterator[tuple[BucketMeta, torch.Tensor]]:
    """The verified buckets of the version directory `directory`, whose manifest.json must be
    `announced` (the manifest given at begin); the manifest is checked before this returns,
    the buckets are read one at a time, each into `place(bucket)` where that gives one."""
    on_disk, buckets = read_version(directory, place)
    check_announced(directory, on_disk, announced)
    return buckets


def check_announced(directory: Path, on_disk: Manifest, announced: Manifest) -> None:
    """`directory`'s manifest.json (`on_disk`) is the manifest given at begin (`announced`):
    every field and every bucket equal, each bucket's digest too where begin named it (a
    trainer may begin without digests: it computes them as it writes). IntegrityError naming
    what differs otherwise."""
    if on_disk.without_digests() != announced.without_digests():
        fields, here = announced.to_dict(buckets=False), on_disk.to_dict(buckets=False)
        differ = [k for k in fields if fields[k] != here[k]] or ["buckets"]
        raise IntegrityError(f"{directory / MANIFEST_FILE} is not the manifest begin announced "
                             f"(differs in {', '.join(differ)}); publish the version begun, or begin the one published")
    wrong = [b.index for b, d in zip(announced.buckets, on_disk.buckets, strict=True)
             if b.digest is not None and b.digest != d.digest]
    if wrong:
        raise IntegrityError(f"{directory / MANIFEST_FILE} is not the manifest begin announced: the digests of "
                             f"bucket(s) {wrong[:8]} differ from begin's")


def confine(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> Path:
    """Resolve `path` (symlinks included) and refuse it unless it lies under `root`."""
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(path))
    if real != real_root and real_root not in real.parents:
        raise PermissionError(
            f"path {str(path)!r} resolves to {str(real)!r}, outside the allowed root {str(real_root)!r}"
        )
    return real


def read_checkpoint_metas(directory: Path) -> list[TensorMeta]:
    """Names, dtypes and shapes of every tensor in a directory's *.safetensors
    files (a model, a PEFT adapter, or a version dir), from headers only, in
    file then header order."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    metas: list[TensorMeta] = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sl = f.get_slice(name)
                metas.append(
                    TensorMeta(hf_name=name, dtype=_dtype_from_st(sl.get_dtype()), shape=tuple(sl.get_shape()))
                )
    return metas


def _dtype_from_st(code: str) -> torch.dtype:
    for dtype, st in _ST_DTYPES.items():
        if st == code:
            return dtype
    raise ManifestError(f"safetensors dtype {code!r} is not supported")
