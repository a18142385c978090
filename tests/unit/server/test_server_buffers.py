"""The engine's reusable receive buffers (`server.buffers`, a fix found by the bench):
reused only after a commit or abort, never while staged, and updates stay exact.

(Lives here because it came with the bench; it belongs with tests/unit/server.)"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from weightsync.bucketing import pack, plan_buckets
from weightsync.integrity import digest
from weightsync.server.buffers import BufferPool
from weightsync.server.updates import WeightUpdater
from weightsync.types import Manifest, TensorMeta


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


def _push(updater: WeightUpdater, weights: dict[str, torch.Tensor], version: int, *, commit: bool = True) -> None:
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in weights.items()], 200)
    packed = [pack(b, {e.hf_name: weights[e.hf_name] for e in b.entries}) for b in plan]
    manifest = Manifest(version=version, buckets=plan)
    updater.begin(manifest)
    for bucket, data in zip(plan, packed, strict=True):
        buffer = updater.buffers.take(bucket.nbytes).copy_(data)  # as the routes receive
        updater.stage_bucket(version=version, index=bucket.index, buffer=buffer, digest_hex=digest(data))
    if commit:
        updater.commit(version)
    else:
        updater.abort(version)


def test_updates_through_reused_buffers_stay_exact() -> None:
    model = Tiny()
    updater = _updater(model)
    gen = torch.Generator().manual_seed(0)
    for version in range(1, 5):
        weights = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        _push(updater, weights, version)
        assert updater.buffers.free_bytes == sum(t.numel() * 4 for t in weights.values())  # all back
        assert updater.digests()[1] == {n: digest(t) for n, t in weights.items()}
    kept = updater.digests()[1]
    _push(updater, {n: torch.zeros(p.shape) for n, p in model.named_parameters()}, 5, commit=False)
    assert updater.digests()[1] == kept and updater.buffers.free_bytes > 0  # an abort returns them too
