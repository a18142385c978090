"""The engine's reusable receive buffers (`server.buffers`, a fix found by the bench):
reused only once no staged update and no served parameter views them, and updates
stay exact. A commit adopts the received buffers as the served weights (no copy).

(Lives here because it came with the bench; it belongs with tests/unit/server.)"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from weightsync.bucketing import pack, plan_buckets
from weightsync.errors import ConflictError, StagingMemoryError
from weightsync.integrity import digest
from weightsync.manifest import Manifest, TensorMeta
from weightsync.receive.staging_memory import STAGING_MARGIN_BYTES
from weightsync.server.buffers import BufferPool
from weightsync.server.updates import WeightUpdater


def test_take_reuses_only_returned_buffers_of_the_same_size() -> None:
    pool = BufferPool(max_bytes=1000)
    a, b = pool.take(100), pool.take(100)
    assert a.dtype == torch.uint8 and a.numel() == 100 and a.data_ptr() != b.data_ptr()
    pool.give([a, a, torch.empty(100, dtype=torch.uint8)])  # a twice, and a stranger
    assert pool.free_bytes == 100
    assert pool.take(100) is a
    assert pool.take(100) is not b  # b was never given back
    assert pool.take(50).numel() == 50


def test_pool_never_holds_more_than_its_cap() -> None:
    pool = BufferPool(max_bytes=250)
    buffers = [pool.take(100) for _ in range(3)]
    pool.give(buffers)
    assert pool.free_bytes == 200
    pool.clear()
    assert pool.free_bytes == 0


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)


def _updater(model: nn.Module) -> WeightUpdater:
    lock = threading.RLock()

    @contextlib.contextmanager
    def between_steps() -> Iterator[None]:
        with lock:
            yield

    return WeightUpdater(model, version=0, between_steps=between_steps, session_timeout_s=60)


def _push(updater: WeightUpdater, weights: dict[str, torch.Tensor], version: int, *, commit: bool = True,
          mode: str = "full", base_version: int | None = None) -> None:
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in weights.items()], 200)
    packed = [pack(b, {e.hf_name: weights[e.hf_name] for e in b.entries}) for b in plan]
    manifest = Manifest(version=version, buckets=plan, mode=mode, base_version=base_version)
    updater.begin(manifest)
    for bucket, data in zip(plan, packed, strict=True):
        buffer = updater.weights.buffers.take(bucket.nbytes).copy_(data)  # as the routes receive
        updater.receive_path.stage(version=version, index=bucket.index, buffer=buffer, digest_hex=digest(data))
    if commit:
        updater.commit(version)
    else:
        updater.abort(version)


def _begin_next(updater: WeightUpdater) -> None:
    """Begin the next update (an empty delta), which makes the last commit final."""
    updater.begin(Manifest(version=updater.version + 1, buckets=[], mode="delta", base_version=updater.version))


def _scribble_on_free_buffers(updater: WeightUpdater) -> None:
    """Take every free buffer and overwrite it, as the next update's receive would."""
    taken = [updater.weights.buffers.take(n) for n, free in list(updater.weights.buffers._free.items()) for _ in free]
    for buffer in taken:
        buffer.fill_(0xFF)
    updater.weights.buffers.give(taken)


def test_updates_through_reused_buffers_stay_exact() -> None:
    model = Tiny()
    updater = _updater(model)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    for version in range(1, 5):
        weights = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        _push(updater, weights, version)
        # the commit adopted this update's buffers; the previous update's are kept for a rollback
        assert updater.weights.buffers.free_bytes == 0
        _begin_next(updater)  # the last commit is final: they come back
        assert updater.weights.buffers.free_bytes == (model_bytes if version > 1 else 0)
        _scribble_on_free_buffers(updater)
        updater.abort(version + 1)
        assert updater.weights.digests()[1] == {n: digest(t) for n, t in weights.items()}
    kept = updater.weights.digests()[1]
    _push(updater, {n: torch.zeros(p.shape) for n, p in model.named_parameters()}, 5, commit=False)
    _scribble_on_free_buffers(updater)
    weights = updater.weights
    assert weights.digests()[1] == kept and weights.buffers.free_bytes == model_bytes  # an abort returns them too


def test_commit_adopts_the_received_bytes_without_copying() -> None:
    model = Tiny()
    updater = _updater(model)
    weights = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    _push(updater, weights, 1)
    served_on = {id(b): b for b in updater.weights._backing.values()}
    assert set(updater.weights._backing) == set(weights) and served_on
    for name, param in model.named_parameters():
        buffer = updater.weights._backing[name]
        assert buffer.data_ptr() <= param.data_ptr() < buffer.data_ptr() + buffer.numel()
    x = torch.ones(2, 16)
    assert torch.equal(model.norm(model.proj(x)), torch.nn.functional.layer_norm(
        torch.nn.functional.linear(x, weights["proj.weight"], weights["proj.bias"]), (8,),
        weights["norm.weight"], weights["norm.bias"]))


def test_partial_update_compacts_the_buffers_it_leaves_partly_served() -> None:
    model = Tiny()
    updater = _updater(model)
    full = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    _push(updater, full, 1)
    assert updater.weights._backing["proj.bias"] is updater.weights._backing["norm.weight"]  # one 200-byte bucket
    delta = {"proj.bias": torch.randn(8)}
    _push(updater, delta, 2, mode="delta", base_version=1)
    # proj.bias now views the delta's buffer; whatever shared its old buffer was cloned out of it
    assert sorted(updater.weights._backing) == ["proj.bias", "proj.weight"]  # norm.* were compacted out
    _scribble_on_free_buffers(updater)
    assert updater.weights.digests()[1] == {n: digest(t) for n, t in (full | delta).items()}


def _served(updater: WeightUpdater) -> dict[str, str]:
    return updater.weights.digests()[1]


def test_rollback_serves_the_previous_version_bit_for_bit() -> None:
    """A commit can be undone until the next update begins: the previous weights, version and
    label are served again, the undone update's buffers go back to the pool, and a second
    rollback is a no-op."""
    model = Tiny()
    updater = _updater(model)
    gen = torch.Generator().manual_seed(1)
    v1 = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    v2 = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    _push(updater, v1, 1)
    _push(updater, v2, 2)
    assert _served(updater) == {n: digest(t) for n, t in v2.items()}
    assert updater.rollback(2) is True
    assert (updater.version, updater.weights.label) == (1, "1")
    assert updater.weights.buffers.free_bytes == sum(p.numel() * 4 for p in model.parameters())  # v2's
    _scribble_on_free_buffers(updater)
    assert _served(updater) == {n: digest(t) for n, t in v1.items()}
    assert updater.rollback(2) is False, "not served: nothing to undo"
    _push(updater, v2, 3)
    assert _served(updater) == {n: digest(t) for n, t in v2.items()}


def test_rollback_of_a_delta_restores_the_tensors_it_compacted() -> None:
    model = Tiny()
    updater = _updater(model)
    full = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    _push(updater, full, 1)
    backing = dict(updater.weights._backing)
    _push(updater, {"proj.bias": torch.randn(8)}, 2, mode="delta", base_version=1)
    assert updater.rollback(2)
    assert updater.weights._backing == backing and not updater.weights.coverage.dirty
    _scribble_on_free_buffers(updater)
    assert _served(updater) == {n: digest(t) for n, t in full.items()}
    for name, param in model.named_parameters():  # the parameters view their buffers again, no copies
        buffer = updater.weights._backing[name]
        assert buffer.data_ptr() <= param.data_ptr() < buffer.data_ptr() + buffer.numel()


def test_a_final_or_foreign_commit_is_not_rolled_back() -> None:
    model = Tiny()
    updater = _updater(model)
    weights = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in weights.items()], 200)
    updater.begin(Manifest(version=1, buckets=plan, owner="trainer-a"))
    updater.receive_path.stage_as_buckets(1, weights)
    updater.commit(1)
    with pytest.raises(ConflictError, match=r"committed by another trainer \(trainer-a\)"):
        updater.rollback(1, owner="trainer-b")
    _begin_next(updater)
    with pytest.raises(ConflictError, match="v1 cannot be rolled back here: it is final"):
        updater.rollback(1, owner="trainer-a")
    assert updater.version == 1 and _served(updater) == {n: digest(t) for n, t in weights.items()}


def test_a_staged_update_reuses_the_rollback_copy_and_the_pool_so_steady_pushes_need_no_new_memory() -> None:
    """The embedded engine keeps the previous version for rollback until the next begin lets it
    go, and lands buckets in its receive pool: from the second push on, staging takes no memory
    beyond what the engine held at begin, and the fit check says so (`staging_reused_bytes`)."""
    updater = _updater(Tiny())
    weights = {n: torch.randn(t.shape) for n, t in updater.weights.params.items()}
    model_bytes = sum(t.nbytes for t in weights.values())
    updater.session.host_available = lambda: STAGING_MARGIN_BYTES  # no room beyond the margin
    with pytest.raises(StagingMemoryError) as refused:  # nothing held to reuse yet: the whole update
        _push(updater, weights, 1)
    assert refused.value.needed_bytes == model_bytes and updater.version == 0
    updater.session.host_available = lambda: STAGING_MARGIN_BYTES + model_bytes
    _push(updater, weights, 1)  # the loaded model is kept for rollback now
    updater.session.host_available = lambda: STAGING_MARGIN_BYTES
    assert updater.staging_reused_bytes(Manifest(version=2)) == model_bytes
    for version in (2, 3):  # the rollback copy (the loaded model, then v1's buffers) is reused
        _push(updater, {n: t + version for n, t in weights.items()}, version)
    assert updater.version == 3
