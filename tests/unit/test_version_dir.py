"""The disk format: bucket files are real safetensors, versions publish atomically,
reads verify, paths stay under their root."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weightsync.bucketing import pack, plan_buckets
from weightsync.errors import IntegrityError
from weightsync.formats.version_dir import (
    bucket_file_header,
    check_announced,
    confine,
    publish,
    read_announced,
    read_bucket,
    read_checkpoint_metas,
    read_version,
    write_bucket,
    write_manifest,
)
from weightsync.integrity import digest
from weightsync.manifest import Manifest, TensorMeta

TENSORS = {
    "model.embed.weight": torch.randn(6, 4),
    "model.norm.weight": torch.randn(4).bfloat16(),
    "flag": torch.tensor(True),
    "empty": torch.zeros(0, 3),
}


def write_version(root: Path, version: int, bucket_bytes: int = 64) -> tuple[Path, Manifest]:
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in TENSORS.items()], bucket_bytes)
    tmp = root / f".tmp-v{version}"
    tmp.mkdir(parents=True)
    digests = []
    for bucket in plan:
        buf = pack(bucket, {n: TENSORS[n] for n in bucket.hf_names})
        digests.append(digest(buf))
        write_bucket(tmp, bucket.with_digest(digests[-1]), buf)
    manifest = Manifest(version=version, buckets=plan).with_digests(digests)
    write_manifest(tmp, manifest)
    final = root / f"v{version:08d}"
    publish(tmp, final)
    return final, manifest


def test_bucket_files_load_with_safetensors(tmp_path: Path) -> None:
    final, manifest = write_version(tmp_path, 1)
    loaded: dict[str, torch.Tensor] = {}
    for b in manifest.buckets:
        loaded.update(load_file(str(final / f"bucket-{b.index:05d}.safetensors")))
    assert set(loaded) == set(TENSORS)
    assert all(torch.equal(loaded[n], t) for n, t in TENSORS.items())
    assert not list(tmp_path.glob(".tmp-*")), "temporary directory renamed away"


def test_golden_header() -> None:
    (bucket,) = plan_buckets([TensorMeta(hf_name="w", dtype=torch.float16, shape=(2,))], 64)
    header = bucket_file_header(bucket, "00000000deadbeef")
    assert header == (
        b"\x98\x00\x00\x00\x00\x00\x00\x00"
        b'{"__metadata__":{"format":"pt","weightsync_bucket":"0","weightsync_digest":"00000000deadbeef"},'
        b'"w":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}    '
    )


def test_read_version_verifies_every_bucket(tmp_path: Path) -> None:
    final, manifest = write_version(tmp_path, 2)
    got, buckets = read_version(final)
    assert got == manifest
    assert sum(buf.numel() for _, buf in buckets) == manifest.num_bytes
    path = final / "bucket-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="digest"):
        read_bucket(final, manifest.buckets[0])
    path.write_bytes(bytes(data[:-3]))
    with pytest.raises(IntegrityError, match="truncated"):
        read_bucket(final, manifest.buckets[0])


def test_a_version_directory_must_hold_the_manifest_begun(tmp_path: Path) -> None:
    """The one check of a version directory against the manifest given at begin (both the
    disk receiver and the embedded server read through it): every field, every bucket, and
    the digests begin named; a begin without digests (the trainer digests as it writes) fits."""
    final, manifest = write_version(tmp_path, 2)
    assert sum(buf.numel() for _, buf in read_announced(final, manifest.without_digests())) == manifest.num_bytes
    check_announced(final, manifest, manifest)
    with pytest.raises(IntegrityError, match=r"not the manifest begin announced \(differs in timeout_s\)"):
        read_announced(final, replace(manifest, timeout_s=5.0))
    with pytest.raises(IntegrityError, match=r"differs in buckets"):
        check_announced(final, manifest, replace(manifest, buckets=manifest.buckets[:1]))
    wrong = manifest.with_digests(["0" * 16, *manifest.digests[1:]])
    with pytest.raises(IntegrityError, match=r"digests of bucket\(s\) \[0\] differ"):
        read_announced(final, wrong)


def test_versions_are_written_once(tmp_path: Path) -> None:
    write_version(tmp_path, 3)
    (tmp_path / "again").mkdir()
    with pytest.raises(FileExistsError):
        publish(tmp_path / "again", tmp_path / "v00000003")


def test_checkpoint_metas_from_headers(tmp_path: Path) -> None:
    final, _ = write_version(tmp_path, 4, bucket_bytes=1 << 20)
    metas = read_checkpoint_metas(final)
    assert {m.hf_name for m in metas} == set(TENSORS)


def test_confine_refuses_escapes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "link")
    assert confine(root / "ok", root) == (root / "ok").resolve()
    with pytest.raises(PermissionError, match="outside the allowed root"):
        confine(root / ".." / "outside", root)
    with pytest.raises(PermissionError, match="outside the allowed root"):
        confine(root / "link", root)
    with pytest.raises(PermissionError):
        confine("/etc/passwd", root)


def test_disk_transport_keeps_the_newest_versions_and_never_the_stale_ones(tmp_path: Path) -> None:
    from weightsync.transports.disk import DiskTransport

    for leftover in (40, 41):  # an earlier run's versions
        (tmp_path / f"v{leftover:08d}").mkdir()
    transport = DiskTransport(tmp_path, keep_versions=2)
    transport.open([1], max_bucket_bytes=1 << 20)
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in TENSORS.items()], 1 << 20)
    for version in (1, 2, 3):
        manifest = Manifest(version=version, buckets=plan)
        transport.begin(manifest)
        (bucket,) = plan
        buf = pack(bucket, {n: TENSORS[n] for n in bucket.hf_names})
        transport.deliver(bucket, buf)
        transport.finish(manifest.with_digests([digest(buf)]))
        assert (tmp_path / f"v{version:08d}" / "manifest.json").exists(), "the version just published stays"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000003"]
