"""Digests, the engine-side manifest dry run, and ack comparison."""

from __future__ import annotations

import pytest
import torch
import xxhash

from weightsync.bucketing import pack, plan_buckets
from weightsync.errors import IntegrityError, ManifestMismatchError
from weightsync.integrity import (
    BucketHasher,
    ack_problems,
    byte_view,
    check_bucket,
    check_manifest_fits,
    digest,
    names_digest,
    with_sent_names,
)
from weightsync.manifest import Manifest, TensorMeta
from weightsync.reports import Ack


def test_digest_is_xxh3_64_of_the_raw_bytes_without_copying() -> None:
    t = torch.arange(10, dtype=torch.bfloat16)
    assert digest(t) == xxhash.xxh3_64_hexdigest(t.view(torch.uint8).numpy().tobytes())
    assert digest(t) == digest(bytes(t.view(torch.uint8).numpy()))
    assert byte_view(t).data_ptr() == t.data_ptr()
    assert digest(torch.tensor(True)) == xxhash.xxh3_64_hexdigest(b"\x01")
    assert digest(t.reshape(2, 5).t()) == digest(t.reshape(2, 5).t().contiguous())


def test_streaming_digest_equals_digest_of_packed_bucket() -> None:
    tensors = {"a": torch.randn(5, 3), "b": torch.randn(4).half(), "c": torch.zeros(0), "d": torch.tensor(7)}
    (bucket,) = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 20)
    packed = pack(bucket, tensors)
    hasher = BucketHasher()
    for e in bucket.entries:
        hasher.update(tensors[e.hf_name])
    assert hasher.hexdigest() == digest(packed)


def test_check_bucket_catches_flips_and_truncation() -> None:
    t = {"w": torch.randn(16)}
    (bucket,) = plan_buckets([TensorMeta.of("w", t["w"])], 1 << 20)
    packed = pack(bucket, t)
    bucket = bucket.with_digest(digest(packed))
    assert check_bucket(bucket, packed) == bucket.digest
    flipped = packed.clone()
    flipped[5] ^= 1
    with pytest.raises(IntegrityError, match="bucket 0: digest .* != expected"):
        check_bucket(bucket, flipped)
    with pytest.raises(IntegrityError, match="received 63 bytes, manifest says 64"):
        check_bucket(bucket, packed[:63])
    with pytest.raises(IntegrityError, match="truncated"):
        check_bucket(bucket, bytes(packed.numpy())[:10])


def _engine_params() -> dict[str, TensorMeta]:
    return {
        "a.weight": TensorMeta(hf_name="a.weight", dtype=torch.float32, shape=(4, 4)),
        "b.weight": TensorMeta(hf_name="b.weight", dtype=torch.bfloat16, shape=(4,)),
        "c.bias": TensorMeta(hf_name="c.bias", dtype=torch.float32, shape=(2,)),
    }


def test_manifest_fits_exactly() -> None:
    params = _engine_params()
    manifest = Manifest(version=1, buckets=plan_buckets(params.values(), 1 << 20))
    check_manifest_fits(manifest, params, partial=False)
    delta = Manifest(version=2, mode="delta", base_version=1,
                     buckets=plan_buckets([params["b.weight"]], 1 << 20))
    check_manifest_fits(delta, params, partial=True)
    with pytest.raises(ManifestMismatchError, match="missing"):
        check_manifest_fits(delta, params, partial=False)


def test_manifest_mismatch_names_every_offender() -> None:
    params = _engine_params()
    sent = [
        TensorMeta(hf_name="a.weight", dtype=torch.float32, shape=(4, 5)),  # reshaped
        TensorMeta(hf_name="b.weight", dtype=torch.float16, shape=(4,)),  # wrong dtype
        TensorMeta(hf_name="renamed.bias", dtype=torch.float32, shape=(2,)),  # renamed
    ]
    manifest = Manifest(version=3, buckets=plan_buckets(sent, 1 << 20))
    with pytest.raises(ManifestMismatchError) as info:
        check_manifest_fits(manifest, params, partial=False)
    err = info.value
    assert err.unexpected == ("renamed.bias",)
    assert err.missing == ("c.bias",)
    assert sorted(err.mismatched) == ["a.weight", "b.weight"]
    text = str(err)
    assert "before any byte moved" in text and "(4, 5)" in text and "torch.float16" in text


def test_ack_problems() -> None:
    params = _engine_params()
    plan = plan_buckets(params.values(), 40)
    manifest = Manifest(version=5, buckets=tuple(b.with_digest(f"{i:016x}") for i, b in enumerate(plan)))
    good = Ack(engine="e", version=5, digests=manifest.digests, loaded_names=frozenset(manifest.hf_names))
    assert ack_problems(manifest, good) == []
    stale = Ack(engine="e", version=4, digests=manifest.digests, loaded_names=frozenset(manifest.hf_names))
    assert any("acked version 4" in p for p in ack_problems(manifest, stale))
    corrupt = Ack(engine="e", version=5, digests=("bad", *manifest.digests[1:]), loaded_names=good.loaded_names)
    assert any("digest mismatch in bucket(s) [0]" in p for p in ack_problems(manifest, corrupt))
    partial = Ack(engine="e", version=5, digests=manifest.digests, loaded_names=frozenset({"a.weight"}))
    assert any("did not load" in p for p in ack_problems(manifest, partial))


def test_names_digest_is_the_digest_of_the_sorted_names_as_json() -> None:
    """Pinned: an engine and a trainer of other releases must compute the same digest."""
    assert names_digest(["b", "a"]) == "7fbae1a42803cdc1" == digest(b'["a","b"]')
    assert names_digest(["model.embed_tokens.weight", "lm_head.weight", "\u00e9"]) == "d37403e00ae4e189"
    assert names_digest(["a", "b"]) != names_digest(["a"]) != names_digest(["a,b"])
    assert names_digest(["a\"", "b"]) != names_digest(['a","b'])  # JSON, not a bare join: no two sets alike


def test_an_ack_of_the_names_digest_proves_coverage_or_is_refused() -> None:
    params = _engine_params()
    plan = plan_buckets(params.values(), 40)
    manifest = Manifest(version=5, buckets=tuple(b.with_digest(f"{i:016x}") for i, b in enumerate(plan)))
    sent = manifest.hf_names
    exact = Ack(engine="e", version=5, digests=manifest.digests, names_digest=names_digest(reversed(sent)))
    filled = with_sent_names(exact, sent)
    assert filled.loaded_names == frozenset(sent) and ack_problems(manifest, filled) == []
    assert ack_problems(manifest, exact) == [], "the digest of the names sent is coverage"
    fewer = Ack(engine="e", version=5, digests=manifest.digests, names_digest=names_digest(sent[1:]))
    assert with_sent_names(fewer, sent) == fewer, "names are filled in only from their own digest"
    assert any("not the 3 names sent" in p for p in ack_problems(manifest, fewer))
    listed = Ack(engine="e", version=5, digests=manifest.digests, loaded_names=frozenset(sent[1:]),
                 names_digest=names_digest(sent[1:]))
    assert with_sent_names(listed, sent) == listed
    assert any("did not load" in p and repr(sent[0]) in p for p in ack_problems(manifest, listed)), \
        "a list names the tensors"
