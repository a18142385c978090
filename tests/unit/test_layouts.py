"""Layouts an engine remembers (`weightsync.server.layouts`) and the begin that names one instead of
sending its buckets (`protocol.BeginRequest.by_layout`): the layout digest, the request's JSON,
what a begin by layout parses to, and that it is checked as a whole begin is."""

from __future__ import annotations

import json

import pytest
import torch

from weightsync.bucketing import pack, plan_buckets
from weightsync.digests import digest
from weightsync.errors import ConflictError, IntegrityError, ManifestError, ManifestMismatchError, UnknownLayoutError
from weightsync.manifest import BucketMeta, Manifest, TensorMeta
from weightsync.protocol import BeginRequest
from weightsync.receive.update_session import OpenUpdate, UpdateSession
from weightsync.server.layouts import Layouts

SHAPES = {"a.weight": ((3, 4), torch.float32), "a.bias": ((3,), torch.float32),
          "b.weight": ((2, 2), torch.bfloat16), "scale": ((), torch.float32)}


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen).to(dtype) for n, (shape, dtype) in SHAPES.items()}


class DictApplier:
    """Weights in a dict, served as version 3 until a commit."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = {k: v.clone() for k, v in weights.items()}
        self.version = 3
        self.released: list[OpenUpdate] = []

    def not_one_version(self) -> str | None:
        return None

    def expected(self) -> dict[str, TensorMeta]:
        return {k: TensorMeta.of(k, v) for k, v in self.weights.items()}

    def check_adapter(self, manifest: Manifest) -> None:
        raise ValueError("no adapters here")

    def apply(self, update: OpenUpdate) -> list[str]:
        self.weights.update({k: t.clone() for k, t in update.tensors.items()})
        self.version = update.version
        return list(update.tensors)

    def install_adapter(self, update: OpenUpdate) -> None:
        raise AssertionError("no adapters here")

    def release(self, update: OpenUpdate) -> None:
        self.released.append(update)


METAS = [TensorMeta.of(n, t) for n, t in new_weights(0).items()]


def _plan(metas: list[TensorMeta] = METAS, bucket_bytes: int = 32) -> tuple[BucketMeta, ...]:
    return plan_buckets(metas, bucket_bytes)


def _remembered(manifest: Manifest) -> tuple[Layouts, str]:
    """An engine's layouts after it accepted `manifest` sent whole (parsed from its JSON)."""
    layouts = Layouts()
    parsed = BeginRequest.from_json(json.loads(BeginRequest(manifest=manifest).to_json_text())).manifest
    return layouts, layouts.remember(parsed, by_layout=False)


def test_the_layout_digest_is_the_plan_and_nothing_else() -> None:
    plan = _plan()
    a = Manifest(version=3, buckets=plan)
    b = Manifest(version=9, buckets=plan, owner="t", timeout_s=5.0).with_digests(["ab" * 8] * len(plan))
    assert a.layout_digest == b.layout_digest
    assert len(a.layout_digest) == 64 and int(a.layout_digest, 16) >= 0
    # parsed back from its JSON (new objects, as an engine holds it): the same digest
    assert Manifest.from_json(b.to_json()).layout_digest == a.layout_digest
    # another shape, dtype, name or bucketing: another layout
    other_shape = [TensorMeta(hf_name=m.hf_name, dtype=m.dtype, shape=(*m.shape, 1)) for m in METAS]
    other_dtype = [TensorMeta(hf_name=m.hf_name, dtype=torch.float16, shape=m.shape) for m in METAS]
    other_name = [TensorMeta(hf_name=m.hf_name + "x", dtype=m.dtype, shape=m.shape) for m in METAS]
    digests = {Manifest(version=3, buckets=p).layout_digest
               for p in (plan, _plan(other_shape), _plan(other_dtype), _plan(other_name), _plan(bucket_bytes=1 << 20))}
    assert len(digests) == 5


def test_a_begin_by_layout_carries_every_field_but_the_buckets() -> None:
    plan = _plan()
    manifest = Manifest(version=4, buckets=plan, owner="trainer-1", timeout_s=7.0).with_digests(
        [f"{i:016x}" for i in range(len(plan))])
    body = json.loads(BeginRequest(manifest=manifest, by_layout=True).to_json_text())
    assert body == BeginRequest(manifest=manifest, by_layout=True).to_json()
    assert set(body) == {"manifest", "layout", "digests"}
    assert body["layout"] == manifest.layout_digest
    assert body["digests"] == [f"{i:016x}" for i in range(len(plan))]
    assert "buckets" not in body["manifest"]
    assert body["manifest"]["version"] == 4 and body["manifest"]["owner"] == "trainer-1"


def test_a_begin_by_a_remembered_layout_parses_to_the_manifest_sent_whole() -> None:
    plan = _plan()
    layouts, layout = _remembered(Manifest(version=3, buckets=plan))
    assert layout == Manifest(version=3, buckets=plan).layout_digest
    sent = Manifest(version=4, buckets=plan, owner="trainer-1").with_digests([f"{i:016x}" for i in range(len(plan))])
    begun = BeginRequest.from_json(json.loads(BeginRequest(manifest=sent, by_layout=True).to_json_text()),
                                   layouts=layouts.get)
    assert begun.by_layout
    assert begun.manifest == sent  # names, dtypes, shapes, offsets, digests, version, owner
    assert begun.manifest.digests == sent.digests
    assert layouts.remember(begun.manifest, by_layout=True) == layout
    assert layouts.info() == {"remembered": [layout], "begins_by_layout": 1, "begins_whole": 1, "unknown": 0}


def test_a_layout_not_remembered_is_refused_naming_it() -> None:
    """After a restart (nothing remembered), or from an engine that began another layout."""
    plan = _plan()
    sent = Manifest(version=4, buckets=plan)
    body = json.loads(BeginRequest(manifest=sent, by_layout=True).to_json_text())
    with pytest.raises(UnknownLayoutError) as refused:
        BeginRequest.from_json(body, layouts=Layouts().get)
    assert refused.value.layout == sent.layout_digest
    assert isinstance(refused.value, ConflictError)  # a 409 where nothing catches it
    with pytest.raises(UnknownLayoutError):
        BeginRequest.from_json(body)  # an engine that remembers none
    layouts, _ = _remembered(Manifest(version=3, buckets=_plan(bucket_bytes=1 << 20)))  # another layout
    with pytest.raises(UnknownLayoutError):
        BeginRequest.from_json(body, layouts=layouts.get)
    assert layouts.info()["unknown"] == 1


def test_a_begin_by_layout_needs_one_digest_or_null_per_bucket() -> None:
    plan = _plan()
    layouts, layout = _remembered(Manifest(version=3, buckets=plan))
    header = Manifest(version=4).to_dict(buckets=False)
    for digests in ([None] * (len(plan) - 1), None, [1] * len(plan)):
        with pytest.raises(ValueError, match="digests"):
            BeginRequest.from_json({"manifest": header, "layout": layout, "digests": digests}, layouts=layouts.get)
    with pytest.raises(ManifestError, match="carries no 'buckets'"):
        BeginRequest.from_json({"manifest": {**header, "buckets": []}, "layout": layout,
                                "digests": [None] * len(plan)}, layouts=layouts.get)


def test_the_manifest_checks_of_the_mode_run_for_a_layout_too() -> None:
    """A remembered full layout named by a sparse begin: its entries lack the tensor digests a
    sparse manifest needs, refused as the same buckets sent whole are."""
    plan = _plan()
    layouts, _ = _remembered(Manifest(version=3, buckets=plan))
    sparse = Manifest(version=4, mode="sparse", base_version=3, buckets=plan)
    with pytest.raises(ManifestError, match="tensor_digest"):
        Manifest.from_json(sparse.to_json())
    with pytest.raises(ManifestError, match="tensor_digest"):
        BeginRequest.from_json(BeginRequest(manifest=sparse, by_layout=True).to_json(), layouts=layouts.get)


def test_only_the_latest_layouts_are_remembered() -> None:
    layouts = Layouts(max_layouts=2)
    digests = [layouts.remember(Manifest(version=1, buckets=_plan(bucket_bytes=b)), by_layout=False)
               for b in (16, 32, 1 << 20)]
    assert len(set(digests)) == 3
    assert layouts.get(digests[0]) is None
    assert layouts.get(digests[1]) is not None and layouts.get(digests[2]) is not None
    layouts.forget()
    assert layouts.info()["remembered"] == []
    with pytest.raises(ValueError, match="max_layouts"):
        Layouts(max_layouts=0)


def test_an_update_begun_by_layout_is_checked_as_one_begun_whole() -> None:
    """What a remembered layout saves is the parse: the dry run against the served weights,
    every bucket's digest and the ack run as for a begin sent whole."""
    weights = new_weights(1)
    plan = _plan()
    buffers = [pack(b, {e.hf_name: weights[e.hf_name] for e in b.entries}) for b in plan]
    sent = [digest(b) for b in buffers]
    layouts, _ = _remembered(Manifest(version=3, buckets=plan))

    def begun(version: int, digests: list[str]) -> Manifest:
        manifest = Manifest(version=version, buckets=plan).with_digests(digests)
        return BeginRequest.from_json(BeginRequest(manifest=manifest, by_layout=True).to_json(),
                                      layouts=layouts.get).manifest

    # an engine whose weights are another shape: refused at begin, naming them
    other = DictApplier({n: t.reshape(-1) if t.dim() > 1 else t for n, t in weights.items()})
    with pytest.raises(ManifestMismatchError) as mismatch:
        UpdateSession(other, engine="e").begin(begun(4, sent))
    assert set(mismatch.value.mismatched) == {"a.weight", "b.weight"}
    assert other.version == 3 and other.released == []

    # bytes that are not the digests': refused, naming the bucket; nothing applied
    applier = DictApplier(new_weights(0))
    before = {n: t.clone() for n, t in applier.weights.items()}
    session = UpdateSession(applier, engine="e")
    wrong = ["0" * 16, *sent[1:]]
    manifest = begun(4, wrong)
    session.begin(manifest)
    with pytest.raises(IntegrityError, match="bucket 0"):
        session.stage_bucket(version=4, index=0, buffer=buffers[0].clone(), digest_hex=wrong[0])
    session.abort(4)
    assert all(torch.equal(applier.weights[n], t) for n, t in before.items()) and applier.version == 3

    # the right bytes: acked with the version, every bucket's digest and the names
    manifest = begun(5, sent)
    session.begin(manifest)
    for bucket, buffer in zip(manifest.buckets, buffers, strict=True):
        session.stage_bucket(version=5, index=bucket.index, buffer=buffer.clone(), digest_hex=bucket.digest)
    ack = session.commit(5)
    assert ack.version == 5 and list(ack.digests) == sent
    assert ack.loaded_names == frozenset(weights)
    assert all(torch.equal(applier.weights[n], t) for n, t in weights.items())
