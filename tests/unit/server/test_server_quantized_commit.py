"""WeightUpdater over a quantized checkpoint, without HTTP: a commit dequantizes each weight with its
scale into the served dtype (float16 here, where a scale too large overflows), refuses what would
serve infinity with the weights unchanged, and the staging check at begin counts the copies it makes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from weightsync.bucketing import pack, plan_buckets
from weightsync.errors import IntegrityError, StagingMemoryError
from weightsync.formats.quantized import INT8_CHANNEL, QuantFormat, Quantization
from weightsync.integrity import digest
from weightsync.manifest import Manifest, TensorMeta
from weightsync.server.quantized import ServedQuantization
from weightsync.server.updates import WeightUpdater

FMT = QuantFormat(kind=INT8_CHANNEL, scale_suffix="weight_scale")
SERVED = ServedQuantization(
    quantization=Quantization(format=FMT, scales={"proj.weight": "proj.weight_scale"}),
    checkpoint={"proj.weight": TensorMeta(hf_name="proj.weight", dtype=torch.int8, shape=(64, 32)),
                "proj.weight_scale": TensorMeta(hf_name="proj.weight_scale", dtype=torch.float32, shape=(64, 1))})


def _updater(staging_bytes_limit: int | None = None) -> WeightUpdater:
    lock = threading.RLock()

    @contextlib.contextmanager
    def between_steps() -> Iterator[None]:
        with lock:
            yield

    model = nn.Module()
    model.proj = nn.Linear(32, 64, bias=False).half().requires_grad_(False)
    return WeightUpdater(model, version=1, between_steps=between_steps, session_timeout_s=60, quantized=SERVED,
                         staging_bytes_limit=staging_bytes_limit)


def _push(updater: WeightUpdater, tensors: dict[str, torch.Tensor], version: int) -> None:
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 20)
    buffers = [pack(b, {e.hf_name: tensors[e.hf_name] for e in b.entries}) for b in plan]
    updater.begin(Manifest(version=version, buckets=plan))
    for bucket, buffer in zip(plan, buffers, strict=True):
        updater.receive_path.stage(version=version, index=bucket.index, buffer=buffer, digest_hex=None)
    updater.commit(version)


def test_commit_dequantizes_into_the_served_dtype_or_refuses_infinity() -> None:
    updater = _updater()
    q, scale = FMT.quantize(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)))
    _push(updater, {"proj.weight": q, "proj.weight_scale": scale}, version=2)
    served = updater.weights.params["proj.weight"]
    assert served.dtype == torch.float16 and torch.equal(served, (q.to(torch.float32) * scale).to(torch.float16))
    before = digest(served)
    huge = scale.clone()
    huge[3] = 1e4  # 127 * 1e4 is finite in float32, infinite in float16
    with pytest.raises(IntegrityError, match=r"update v3 refused, this server stays on v2: 'proj.weight' dequantize "
                                             r"to NaN or infinity"):
        _push(updater, {"proj.weight": q, "proj.weight_scale": huge}, version=3)
    assert updater.version == 2 and digest(updater.weights.params["proj.weight"]) == before


def test_staging_counts_the_dequantized_copies() -> None:
    """The update stages 64*32 + 64*4 bytes and its commit makes a 64*32*2-byte float16 copy."""
    q, scale = FMT.quantize(torch.randn(64, 32))
    quantized = q.numel() + scale.numel() * 4
    updater = _updater(staging_bytes_limit=quantized + q.numel() * 2)
    updater.session.host_available = lambda: None
    _push(updater, {"proj.weight": q, "proj.weight_scale": scale}, version=2)
    updater = _updater(staging_bytes_limit=quantized + q.numel() * 2 - 1)
    updater.session.host_available = lambda: None
    with pytest.raises(StagingMemoryError):
        _push(updater, {"proj.weight": q, "proj.weight_scale": scale}, version=2)
