"""update_session.UpdateSession: the engine side of an update, against a dict of weights.

The applier here is a test double on purpose: the session is the unit under
test; the embedded engine, the vLLM worker and tests/unit/test_sync.py's
MemoryEngine run the same session against their own appliers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest
import torch

from weightsync.bucketing import pack, plan_buckets
from weightsync.change_encoding import encode
from weightsync.errors import ConflictError, IntegrityError, ManifestError, ManifestMismatchError, StagingMemoryError
from weightsync.integrity import digest, names_digest, with_sent_names
from weightsync.manifest import Manifest, TensorMeta
from weightsync.owners import session_owner
from weightsync.receive.staging_memory import STAGING_MARGIN_BYTES, staging_bytes
from weightsync.receive.update_session import OpenUpdate, SessionRules, UpdateSession
from weightsync.reports import Ack


class DictApplier:
    """Weights in a dict; records what the session asked of it."""

    def __init__(self, weights: dict[str, torch.Tensor], version: int = 3) -> None:
        self.weights = {k: v.clone() for k, v in weights.items()}
        self.version = version
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.released: list[OpenUpdate] = []
        self.fail_apply = False
        self.mixed: str | None = None
        """Why the weights are not one version's (the engine's not_one_version)."""

    def not_one_version(self) -> str | None:
        return self.mixed

    def expected(self) -> dict[str, TensorMeta]:
        return {k: TensorMeta.of(k, v) for k, v in self.weights.items()}

    def check_adapter(self, manifest: Manifest) -> None:
        if any(not n.endswith(("lora_A.weight", "lora_B.weight")) for n in manifest.hf_names):
            raise ValueError("not an adapter")

    def apply(self, update: OpenUpdate) -> Sequence[str]:
        if self.fail_apply:
            raise RuntimeError("injected apply failure")
        self.weights.update({k: t.clone() for k, t in update.tensors.items()})
        self.version = update.version
        return list(update.tensors)

    def install_adapter(self, update: OpenUpdate) -> None:
        assert update.manifest.lora_name is not None
        self.adapters[update.manifest.lora_name] = dict(update.tensors)
        self.version = update.version

    def release(self, update: OpenUpdate) -> None:
        self.released.append(update)


WEIGHTS = {
    "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "a.bias": torch.zeros(3),
    "b.weight": torch.ones(2, 2, dtype=torch.bfloat16),
    "scale": torch.tensor(2.0),
}


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in WEIGHTS.items()}


def update(weights: dict[str, torch.Tensor], version: int, **manifest: object) -> tuple[Manifest, list[torch.Tensor]]:
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in weights.items()], 32)
    buffers = [pack(b, {e.hf_name: weights[e.hf_name] for e in b.entries}) for b in plan]
    algorithm = str(manifest.get("digest_algorithm", "xxh3_64"))
    return Manifest(version=version, buckets=plan, **manifest).with_digests(  # type: ignore[arg-type]
        [digest(b, algorithm) for b in buffers]), buffers  # type: ignore[arg-type]


def session(applier: DictApplier, **rules: object) -> UpdateSession:
    return UpdateSession(applier, engine="test engine", rules=SessionRules(**rules))  # type: ignore[arg-type]


def stage_all(s: UpdateSession, manifest: Manifest, buffers: list[torch.Tensor]) -> list[str]:
    return [s.stage_bucket(version=manifest.version, index=b.index, buffer=buf.clone(), digest_hex=b.digest)
            for b, buf in zip(manifest.buckets, buffers, strict=False)]  # the first len(buffers)


def unchanged(applier: DictApplier) -> bool:
    return all(torch.equal(applier.weights[k], v) for k, v in WEIGHTS.items())


class ShortApplier(DictApplier):
    """An applier that loads all but one of the names staged (a loader that skips one)."""

    def apply(self, update: OpenUpdate) -> Sequence[str]:
        return list(super().apply(update))[1:]


def test_an_engine_that_loaded_other_names_than_its_manifests_acks_them_as_a_list() -> None:
    """The digest stands for the list only where the engine loaded exactly the manifest's
    names; otherwise the trainer gets the list, so its error names the tensors."""
    s = session(ShortApplier(WEIGHTS))
    manifest, buffers = update(new_weights(1), 4)
    s.begin(manifest.without_digests())
    stage_all(s, manifest, buffers)
    ack = s.commit(4)
    assert ack.names_digest is None and len(ack.loaded_names) == len(WEIGHTS) - 1
    assert "names_digest" not in ack.to_wire(names_digest=True)
    assert ack.to_wire(names_digest=True)["loaded_names"] == sorted(ack.loaded_names)


def test_commit_acks_what_arrived_and_applies_it_at_once() -> None:
    applier = DictApplier(WEIGHTS)
    s = session(applier)
    weights = new_weights(1)
    manifest, buffers = update(weights, 4)
    assert len(manifest.buckets) > 1
    s.begin(manifest.without_digests())
    digests = stage_all(s, manifest, buffers)
    assert digests == list(manifest.digests)
    assert unchanged(applier) and applier.version == 3, "nothing is applied before commit"
    ack = s.commit(4).without_memory()  # its memory figures: test_process_memory.py
    assert ack == Ack(engine="test engine", version=4, digests=manifest.digests,
                      loaded_names=frozenset(weights), names_digest=names_digest(weights))
    assert ack.to_wire() == {"version": 4, "digests": list(manifest.digests), "loaded_names": sorted(weights)}
    assert Ack.from_dict(ack.to_wire(), engine="test engine") == replace(ack, names_digest=None)
    # where the trainer asks for it (CommitRequest.names_digest), the names travel as their digest
    short = ack.to_wire(names_digest=True)
    assert short == {"version": 4, "digests": list(manifest.digests), "names_digest": names_digest(weights)}
    assert with_sent_names(Ack.from_dict(short, engine="test engine"), manifest.hf_names) == ack
    assert all(torch.equal(applier.weights[k], v) for k, v in weights.items()) and applier.version == 4
    assert s.open_update is None and applier.released[-1].version == 4


def test_named_tensors_are_acked_with_the_digest_of_their_bucket() -> None:
    applier = DictApplier(WEIGHTS)
    s = session(applier)
    weights = new_weights(2)
    manifest, _ = update(weights, 4)
    s.begin(manifest)
    with pytest.raises(ManifestMismatchError):
        s.stage_named(4, [("a.bias", weights["a.bias"][:-1])])
    s.stage_named(4, list(weights.items()))
    assert s.commit(4).digests == manifest.digests


def test_a_digest_algorithm_this_side_does_not_compute_is_refused_at_begin() -> None:
    applier = DictApplier(WEIGHTS)
    s = session(applier)
    manifest, _ = update(new_weights(5), 4)
    with pytest.raises(ManifestError, match="test engine does not compute the digest algorithm 'blake3' the manifest "
                                            "names; it computes xxh3_64, wsmix64"):
        s.begin(replace(manifest.without_digests(), digest_algorithm="blake3"))
    assert s.open_update is None and unchanged(applier)


def test_buckets_are_checked_and_acked_with_the_manifests_algorithm() -> None:
    applier = DictApplier(WEIGHTS)
    s = session(applier)
    weights = new_weights(6)
    manifest, buffers = update(weights, 4, digest_algorithm="wsmix64")
    assert manifest.digests == tuple(digest(b, "wsmix64") for b in buffers)
    assert manifest.digests != tuple(digest(b) for b in buffers)
    s.begin(manifest.without_digests())
    assert stage_all(s, manifest, buffers) == list(manifest.digests)
    assert s.commit(4).digests == manifest.digests
    # tensors staged by name are acked with the digest of their bucket, in the same algorithm
    named = session(DictApplier(WEIGHTS))
    named.begin(manifest)
    named.stage_named(4, list(weights.items()))
    assert named.commit(4).digests == manifest.digests
    # and a bucket hashed with the other algorithm is refused
    other, xxh3_buffers = update(weights, 5)
    s.begin(replace(other, digest_algorithm="wsmix64"))
    with pytest.raises(IntegrityError, match="bytes were corrupted in transit"):
        stage_all(s, other, xxh3_buffers)


@pytest.mark.parametrize("version", [2, 3])
def test_versions_must_increase(version: int) -> None:
    s = session(DictApplier(WEIGHTS))
    with pytest.raises(ConflictError, match=f"version {version} is not newer than the served v3"):
        s.begin(update(new_weights(3), version)[0])
    assert s.open_update is None


def test_an_adapter_may_keep_the_served_version_where_the_rules_say_so() -> None:
    adapter = {
        "base_model.model.a.lora_A.weight": torch.ones(1, 4),
        "base_model.model.a.lora_B.weight": torch.ones(3, 1),
    }
    manifest, buffers = update(adapter, 3, mode="lora", lora_name="ad")
    with pytest.raises(ConflictError, match="not newer"):
        session(DictApplier(WEIGHTS)).begin(manifest)  # the vLLM worker's rule
    applier = DictApplier(WEIGHTS)
    s = session(applier, adapter_keeps_version=True)  # the embedded engine's rule
    s.begin(manifest)
    stage_all(s, manifest, buffers)
    assert s.commit(3).loaded_names == frozenset(adapter)
    assert set(applier.adapters["ad"]) == set(adapter) and unchanged(applier)
    with pytest.raises(ConflictError, match="not newer"):  # base weights never keep it
        s.begin(update(new_weights(4), 3)[0])


def test_delta_needs_its_base_or_is_refused_by_rule() -> None:
    weights = {"a.bias": new_weights(5)["a.bias"]}
    s = session(DictApplier(WEIGHTS))
    with pytest.raises(ConflictError, match="serves v3; send a full update"):
        s.begin(update(weights, 4, mode="delta", base_version=2)[0])
    mixed = DictApplier(WEIGHTS)
    mixed.mixed = "its weights were released"
    with pytest.raises(ConflictError, match="serves v3 in name only, its weights were released; send a full"):
        session(mixed).begin(update(weights, 4, mode="delta", base_version=3)[0])
    s.begin(update(weights, 4, mode="delta", base_version=3)[0])
    refusing = session(DictApplier(WEIGHTS), refuse_delta="no deltas here; send mode='full'")
    with pytest.raises(ConflictError, match="no deltas here"):
        refusing.begin(update(weights, 4, mode="delta", base_version=3)[0])


def test_a_live_trainers_session_is_never_taken() -> None:
    s = session(DictApplier(WEIGHTS))
    a, b = session_owner(), session_owner()
    manifest = update(new_weights(6), 5)[0]
    s.begin(replace(manifest, owner=a, timeout_s=30.0))
    with pytest.raises(ConflictError, match=f"held by trainer {a}") as busy:
        s.begin(replace(manifest, version=6, owner=b, timeout_s=30.0))
    assert busy.value.retry_after_s is not None and 0 < busy.value.retry_after_s <= 30.0
    assert s.open_update is not None and s.open_update.owner == a, "a refused begin leaves the open update"
    assert s.begin(replace(manifest, version=6, owner=a, timeout_s=30.0)) is None  # its own trainer again
    assert s.open_update is not None and s.open_update.version == 6
    s.open_update.touched -= 31.0  # a's silence, past its own timeout
    assert "past its timeout" in (s.begin(replace(manifest, version=7, owner=b, timeout_s=30.0)) or "")
    assert s.open_update is not None and s.open_update.owner == b


def test_abort_is_owner_aware_and_idempotent() -> None:
    applier = DictApplier(WEIGHTS)
    s = session(applier)
    a, b = session_owner(), session_owner()
    manifest, buffers = update(new_weights(7), 5, owner=a)
    s.begin(manifest)
    stage_all(s, manifest, buffers[:1])
    assert s.abort(5, owner=b) is False, "an abort never drops another trainer's update"
    assert s.abort(4) is False and s.open_update is not None
    assert s.abort(5, owner=a) is True and s.open_update is None
    assert s.abort(5) is False and s.abort() is False
    assert unchanged(applier) and applier.version == 3 and len(applier.released) == 1


def test_a_bad_index_is_refused() -> None:
    s = session(DictApplier(WEIGHTS))
    manifest, buffers = update(new_weights(8), 4)
    s.begin(manifest)
    for index in (-1, len(manifest.buckets)):
        with pytest.raises(ValueError, match=f"bucket index {index} out of range"):
            s.stage_bucket(version=4, index=index, buffer=buffers[0].clone())
    with pytest.raises(ConflictError, match="is v4, not v5"):
        s.stage_bucket(version=5, index=0, buffer=buffers[0].clone())
    assert s.open_update is not None and not s.open_update.tensors


def test_corrupted_bytes_are_refused_and_nothing_is_applied() -> None:
    applier = DictApplier(WEIGHTS)
    s = session(applier)
    manifest, buffers = update(new_weights(9), 4)
    s.begin(manifest)
    corrupt = buffers[0].clone()
    corrupt[0] ^= 1
    with pytest.raises(IntegrityError, match="bucket 0: digest"):
        s.stage_bucket(version=4, index=0, buffer=corrupt)  # against the manifest's digest
    assert s.abort(4) is True
    s.begin(replace(manifest.without_digests(), version=5))
    with pytest.raises(IntegrityError, match=r"bucket 0: digest .* != sent"):
        s.stage_bucket(version=5, index=0, buffer=corrupt, digest_hex=manifest.buckets[0].digest)
    with pytest.raises(IntegrityError, match="truncated"):
        s.stage_bucket(version=5, index=0, buffer=buffers[0][:-1].clone())
    assert s.open_update is not None and not s.open_update.tensors
    with pytest.raises(IntegrityError, match="never arrived"):
        s.commit(5)
    assert unchanged(applier) and applier.version == 3


def test_commit_names_what_never_arrived_and_keeps_the_update_open() -> None:
    applier = DictApplier(WEIGHTS)
    s = session(applier)
    manifest, buffers = update(new_weights(10), 4)
    s.begin(manifest)
    stage_all(s, manifest, buffers[:-1])
    missing = manifest.buckets[-1].hf_names
    with pytest.raises(IntegrityError, match=f"{len(missing)} tensor\\(s\\) never arrived: .*{missing[0]}"):
        s.commit(4)
    assert unchanged(applier) and s.open_update is not None
    s.stage_bucket(version=4, index=manifest.buckets[-1].index, buffer=buffers[-1].clone())
    assert s.commit(4).version == 4 and applier.version == 4


def test_a_failed_apply_closes_the_update() -> None:
    applier = DictApplier(WEIGHTS)
    applier.fail_apply = True
    s = session(applier)
    manifest, buffers = update(new_weights(11), 4)
    s.begin(manifest)
    stage_all(s, manifest, buffers)
    with pytest.raises(RuntimeError, match="injected"):
        s.commit(4)
    assert s.open_update is None and applier.released and applier.version == 3
    with pytest.raises(ConflictError, match="no update session is open"):
        s.commit(4)


def test_a_replaced_update_frees_what_it_held() -> None:
    applier = DictApplier(WEIGHTS)
    s = session(applier)
    owner = session_owner()
    first, buffers = update(new_weights(12), 4, owner=owner)
    s.begin(first)
    stage_all(s, first, buffers[:1])
    s.begin(update(new_weights(12), 5, owner=owner)[0])  # its trainer begins again
    assert [u.version for u in applier.released] == [4]
    assert s.drop_if_idle() is False
    assert s.open_update is not None
    s.open_update.touched -= s.open_update.timeout_s + 1.0
    assert s.drop_if_idle() is True and s.open_update is None


class SparseDictApplier(DictApplier):
    """A DictApplier that applies sparse updates (`update_session.SparseBase`)."""

    def base_tensor(self, hf_name: str) -> torch.Tensor:
        return self.weights[hf_name]


def sparse_update(new: dict[str, torch.Tensor], base: dict[str, torch.Tensor], version: int, *,
                  base_version: int = 3, lie_about: str | None = None,
                  bucket_bytes: int = 32) -> tuple[Manifest, list[torch.Tensor]]:
    """A "sparse" update from `base` to `new`, every tensor encoded as `change_encoding.encode` picks;
    `lie_about`: that tensor's whole-tensor digest is announced wrong (the payload is right)."""
    metas, tensors = [], {}
    for name, tensor in new.items():
        enc = encode(tensor, base[name])
        whole = digest(tensor.contiguous()) if name != lie_about else "0" * 16
        metas.append(TensorMeta(hf_name=name, dtype=tensor.dtype, shape=tuple(tensor.shape), encoding=enc.encoding,
                                num_changed=enc.num_changed if enc.payload is not None else 0, tensor_digest=whole))
        tensors[name] = enc.payload if enc.payload is not None else tensor
    plan = plan_buckets(metas, bucket_bytes)
    buffers = [pack(b, {e.hf_name: tensors[e.hf_name] for e in b.entries}) for b in plan]
    manifest = Manifest(version=version, mode="sparse", base_version=base_version, buckets=plan)
    return manifest.with_digests([digest(b) for b in buffers]), buffers


def test_a_sparse_update_is_rebuilt_on_the_served_tensors_and_acks_whole_digests() -> None:
    applier = SparseDictApplier(WEIGHTS)
    s = session(applier)
    new = {n: t.clone() for n, t in WEIGHTS.items()}
    new["a.weight"][1, 2] = 100.0
    new["b.weight"][0, 0] = -3.0
    manifest, buffers = sparse_update(new, WEIGHTS, 4)
    assert {e.encoding for e in manifest.entries()} >= {"positions16"}
    s.begin(manifest)
    stage_all(s, manifest, buffers)
    ack = s.commit(4)
    assert applier.version == 4
    assert all(torch.equal(applier.weights[n].view(-1).view(torch.uint8), new[n].view(-1).view(torch.uint8))
               for n in new)
    assert ack.tensor_digests == {n: digest(t.contiguous()) for n, t in new.items()}


def test_a_sparse_update_whose_whole_tensor_differs_is_refused_and_nothing_changes() -> None:
    applier = SparseDictApplier(WEIGHTS)
    s = session(applier)
    new = {n: t.clone() for n, t in WEIGHTS.items()}
    new["a.weight"][0, 0] = 7.0
    manifest, buffers = sparse_update(new, WEIGHTS, 4, lie_about="a.weight")
    s.begin(manifest)
    stage_all(s, manifest, buffers)
    with pytest.raises(IntegrityError, match=r"stays on v3: 1 tensor\(s\) differ .*a\.weight"):
        s.commit(4)
    assert applier.version == 3 and unchanged(applier) and s.open_update is None


def test_a_sparse_update_needs_its_base_and_an_engine_that_applies_it() -> None:
    new = {n: t.clone() for n, t in WEIGHTS.items()}
    new["a.bias"][0] = 1.0
    manifest, _ = sparse_update(new, WEIGHTS, 4)
    with pytest.raises(ConflictError, match="test engine does not apply sparse updates"):
        session(DictApplier(WEIGHTS)).begin(manifest)  # no base_tensor: 409, the trainer sends it whole
    with pytest.raises(ConflictError, match="sparse update v4 applies on top of v2, but test engine serves v3"):
        session(SparseDictApplier(WEIGHTS)).begin(sparse_update(new, WEIGHTS, 4, base_version=2)[0])


class StreamedDictApplier(SparseDictApplier):
    """A SparseDictApplier that takes streamed commits (`update_session.StreamedLoader`):
    records what it was asked, in order."""

    def __init__(self, weights: dict[str, torch.Tensor], version: int = 3) -> None:
        super().__init__(weights, version)
        self.calls: list[str] = []
        self.refusal: str | None = None

    def hold(self, update: OpenUpdate) -> None:
        self.calls.append(f"hold v{update.version}")

    def load(self, update: OpenUpdate, tensors: Mapping[str, torch.Tensor]) -> None:
        self.calls.append("load " + ",".join(tensors))
        for name, tensor in tensors.items():
            self.weights[name].copy_(tensor)

    def finish(self, update: OpenUpdate) -> Sequence[str]:
        self.calls.append(f"finish v{update.version}")
        self.version, self.refusal = update.version, None
        return sorted(update.loaded)

    def abandon(self, update: OpenUpdate, reason: str) -> None:
        self.calls.append(f"abandon v{update.version}")
        if update.loaded:
            self.refusal = reason


def streamed(manifest: Manifest) -> Manifest:
    return replace(manifest, commit="streamed")


def test_a_streamed_update_loads_each_bucket_as_it_arrives_and_stages_nothing() -> None:
    applier = StreamedDictApplier(WEIGHTS)
    s = session(applier)
    new = new_weights(21)
    manifest, buffers = update(new, 4)
    manifest = streamed(manifest)
    assert len(manifest.buckets) >= 2
    s.begin(manifest)
    assert applier.calls == ["hold v4"]
    stage_all(s, manifest, buffers[:1])
    assert applier.calls[-1] == "load " + ",".join(manifest.buckets[0].hf_names)
    open_update = s.open_update
    assert open_update is not None and not open_update.tensors and not open_update.buffers  # let go
    assert s.serves_whole(4) is False  # never adopted: the bytes are copied into the served weights
    for bucket, buffer in zip(manifest.buckets[1:], buffers[1:], strict=True):
        s.stage_bucket(version=4, index=bucket.index, buffer=buffer.clone())
    ack = s.commit(4)
    assert applier.calls[-1] == "finish v4" and applier.version == 4 and applier.refusal is None
    assert ack.digests == manifest.digests and ack.names_digest == names_digest(manifest.hf_names)
    assert all(torch.equal(applier.weights[n], new[n]) for n in new)


def test_a_streamed_update_that_fails_midway_leaves_the_engine_refusing_with_the_reason() -> None:
    applier = StreamedDictApplier(WEIGHTS)
    s = session(applier)
    manifest, buffers = update(new_weights(22), 4)
    manifest = streamed(manifest)
    s.begin(manifest)
    stage_all(s, manifest, buffers[:1])
    corrupt = buffers[1].clone()
    corrupt[0] ^= 1
    with pytest.raises(IntegrityError, match="bucket 1: digest"):
        s.stage_bucket(version=4, index=1, buffer=corrupt)
    assert applier.calls[-1].startswith("load ")  # bucket 1 was not loaded
    assert s.abort(4) is True
    assert applier.calls[-1] == "abandon v4" and applier.version == 3
    assert applier.refusal is not None and "bucket 1: digest" in applier.refusal and "aborted" in applier.refusal
    # a full update afterwards lands, streamed or not, and clears it
    s.begin(replace(update(WEIGHTS, 5)[0], commit="streamed"))
    stage_all(s, *update(WEIGHTS, 5))
    s.commit(5)
    assert applier.refusal is None and unchanged(applier)


def test_a_streamed_update_aborted_before_its_first_bucket_refuses_nothing() -> None:
    applier = StreamedDictApplier(WEIGHTS)
    s = session(applier)
    s.begin(streamed(update(new_weights(23), 4)[0]))
    assert s.abort(4) is True
    assert applier.calls == ["hold v4", "abandon v4"] and applier.refusal is None and unchanged(applier)


def test_a_streamed_update_whose_trainer_went_silent_is_dropped_refusing() -> None:
    applier = StreamedDictApplier(WEIGHTS)
    s = session(applier)
    manifest, buffers = update(new_weights(24), 4, timeout_s=0.001)
    manifest = streamed(manifest)
    s.begin(manifest)
    stage_all(s, manifest, buffers[:1])
    assert s.open_update is not None
    s.open_update.touched -= 1.0  # silent for longer than its timeout, without waiting
    assert s.drop_if_idle() is True
    assert applier.refusal is not None and "silent" in applier.refusal


def test_a_streamed_sparse_update_is_rebuilt_bucket_by_bucket_and_checked_whole() -> None:
    applier = StreamedDictApplier(WEIGHTS)
    s = session(applier)
    new = {n: t.clone() for n, t in WEIGHTS.items()}
    new["a.weight"][1, 2] = 100.0
    new["b.weight"][0, 0] = -3.0
    manifest, buffers = sparse_update(new, WEIGHTS, 4, bucket_bytes=8)
    s.begin(streamed(manifest))
    stage_all(s, manifest, buffers)
    ack = s.commit(4)
    assert all(torch.equal(applier.weights[n].view(-1).view(torch.uint8), new[n].view(-1).view(torch.uint8))
               for n in new)
    assert ack.tensor_digests == {n: digest(t.contiguous()) for n, t in new.items()}

    assert len(manifest.buckets) >= 2
    last = manifest.buckets[-1].hf_names[0]
    applier = StreamedDictApplier(WEIGHTS)
    s = session(applier)
    manifest, buffers = sparse_update(new, WEIGHTS, 4, lie_about=last, bucket_bytes=8)
    s.begin(streamed(manifest))
    with pytest.raises(IntegrityError, match=rf"1 tensor\(s\) differ .*{last}"):
        stage_all(s, manifest, buffers)
    assert torch.equal(applier.weights[last], WEIGHTS[last])  # its bucket loaded nothing
    s.abort(4)
    assert applier.version == 3 and applier.refusal is not None and last in applier.refusal


def test_a_streamed_update_is_refused_by_an_engine_that_cannot_stream() -> None:
    with pytest.raises(ConflictError, match="does not take a streamed commit; send commit='staged'"):
        session(DictApplier(WEIGHTS)).begin(streamed(update(new_weights(25), 4)[0]))


def test_the_commit_kind_travels_in_the_manifest_only_when_streamed() -> None:
    manifest = update(WEIGHTS, 4)[0]
    assert "commit" not in manifest.to_dict()
    assert Manifest.from_dict(manifest.to_dict()).commit == "staged"
    assert Manifest.from_json(streamed(manifest).to_json()).commit == "streamed"
    with pytest.raises(ManifestError, match="unknown commit 'eager'"):
        Manifest.from_dict({**manifest.to_dict(), "commit": "eager"})


def _refusal(s: UpdateSession, manifest: Manifest) -> StagingMemoryError:
    with pytest.raises(StagingMemoryError) as refused:
        s.begin(manifest)
    return refused.value


def test_a_staged_update_that_would_not_fit_in_memory_is_refused_at_begin_naming_bytes_and_fix() -> None:
    applier = StreamedDictApplier(WEIGHTS)
    s = session(applier)
    manifest, buffers = update(new_weights(20), 4)
    needed = manifest.num_bytes
    s.host_available = lambda: STAGING_MARGIN_BYTES + needed - 1  # one byte short
    e = _refusal(s, manifest)
    assert (e.needed_bytes, e.available_bytes) == (needed, needed - 1)
    message = str(e)
    assert f"needs {needed} bytes" in message and f"has {STAGING_MARGIN_BYTES + needed - 1} available" in message
    assert 'commit="streamed"' in message and "test engine keeps serving" in message
    assert s.open_update is None and applier.calls == [] and unchanged(applier) and applier.version == 3
    s.begin(streamed(manifest))  # a streamed update holds a bucket or two: never checked
    s.abort(4)
    s.host_available = lambda: STAGING_MARGIN_BYTES + needed  # exactly enough
    s.begin(manifest)
    stage_all(s, manifest, buffers)
    assert s.commit(4).version == 4


def test_an_engine_that_cannot_stream_says_so_and_every_copy_on_the_host_counts() -> None:
    applier = DictApplier(WEIGHTS)
    s = session(applier, num_staging_copies=3)
    manifest, _ = update(new_weights(21), 4)
    s.host_available = lambda: STAGING_MARGIN_BYTES + 3 * manifest.num_bytes - 1
    e = _refusal(s, manifest)
    assert e.needed_bytes == 3 * manifest.num_bytes
    assert 'test engine does not take commit="streamed"' in str(e) and "more memory" in str(e)
    s.host_available = lambda: STAGING_MARGIN_BYTES + 3 * manifest.num_bytes
    s.begin(manifest)


def test_staging_counts_sparse_tensors_rebuilt_whole_and_reuses_what_the_engine_lets_go() -> None:
    new = {n: t.clone() for n, t in WEIGHTS.items()}
    new["a.weight"][1, 2] += 1.0
    manifest, _ = sparse_update(new, WEIGHTS, 4, bucket_bytes=64)
    rebuilt = [e for e in manifest.entries() if not e.is_dense]
    whole = sum(WEIGHTS[e.hf_name].nbytes for e in rebuilt)  # each served tensor, copied and patched at commit
    assert rebuilt and staging_bytes(manifest) == manifest.num_bytes + whole

    class ReusingApplier(SparseDictApplier):
        reused = 0

        def staging_reused_bytes(self, manifest: Manifest) -> int:
            return self.reused

    applier = ReusingApplier(WEIGHTS)
    s = session(applier)
    s.host_available = lambda: STAGING_MARGIN_BYTES
    assert _refusal(s, manifest).needed_bytes == staging_bytes(manifest)
    applier.reused = staging_bytes(manifest) - 1
    assert _refusal(s, manifest).needed_bytes == 1
    applier.reused += 1
    s.begin(manifest)


def test_without_proc_nothing_is_checked_but_an_engines_limit_is() -> None:
    s = session(DictApplier(WEIGHTS), staging_bytes_limit=10)
    s.host_available = lambda: None
    manifest, _ = update(new_weights(22), 4)
    e = _refusal(s, manifest)
    assert (e.needed_bytes, e.available_bytes) == (manifest.num_bytes, 10) and "--staging-bytes-limit" in str(e)
    session(DictApplier(WEIGHTS)).begin(manifest)  # the host's figures, if any: a few bytes fit
    s = session(DictApplier(WEIGHTS))
    s.host_available = lambda: None
    s.begin(manifest)
