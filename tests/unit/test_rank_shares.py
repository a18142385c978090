"""One rank's side of a push in shares (`weightsync.push.rank_shares.send_shares`), without a
process group (one rank holds every tensor whole): the shares assemble into exactly the
buckets the ordinary pipeline packs, with their whole wsmix64 digests, and an overflowing
cast is refused before any share is sent. The two-rank path runs in
tests/distributed/test_fsdp_shares.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from weightsync.bucketing import pack, plan_buckets
from weightsync.digests import WSMIX64, digest
from weightsync.errors import CastError
from weightsync.formats.shares import Assembly, Share
from weightsync.manifest import TensorMeta
from weightsync.push.rank_shares import ShareOrder, send_shares
from weightsync.sources.module import ModuleSource
from weightsync.trainer_ranks import TrainerRanks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8), nn.LayerNorm(8))


def _order(source: ModuleSource, dtype: torch.dtype) -> ShareOrder:
    metas = [TensorMeta(hf_name=m.hf_name, dtype=dtype, shape=m.shape) for m in source.metas()]
    return ShareOrder(version=3, buckets=plan_buckets(metas, 300))


def test_one_ranks_shares_assemble_into_the_packed_buckets_with_their_whole_digests() -> None:
    model = _model()
    source = ModuleSource(model)
    order = _order(source, torch.bfloat16)
    assert len(order.buckets) > 2
    sent: list[Share] = []  # copies: a share's bytes are its buffer's until it was sent
    digests = send_shares(source, order, TrainerRanks(None), timeout_s=10,
                          deliver=lambda share: sent.append(replace(share, data=share.data.clone())))
    sent.sort(key=lambda share: share.index)  # two go out at once: they may be handed over in either order
    assert digests is not None and [s.index for s in sent] == [b.index for b in order.buckets]
    params = dict(model.named_parameters())
    assembly = Assembly()
    for share, bucket, whole in zip(sent, order.buckets, digests, strict=True):
        want = pack(bucket, {e.hf_name: params[e.hf_name].detach().to(torch.bfloat16) for e in bucket.entries})
        assert share.digest == whole == digest(want, WSMIX64)
        got = assembly.add(version=3, index=bucket.index, nbytes=bucket.nbytes, whole_digest=whole,
                           num_ranges=len(share.ranges), share_digest=share.payload_digest(),
                           payload=memoryview(b"".join(bytes(p) for p in share.payload())),
                           alloc=lambda n: torch.empty(n, dtype=torch.uint8))
        assert got is not None and torch.equal(got, want), "cast exactly as tensor.to(dtype)"


def test_an_overflowing_cast_is_refused_before_any_share_is_sent() -> None:
    model = _model()
    with torch.no_grad():
        model[2].weight[0, 0] = 1e6  # beyond float16's 65504
    source = ModuleSource(model)
    sent: list[Share] = []
    with pytest.raises(CastError, match=r"trainer rank 0 could not send its share: CastError: casting '2.weight'"):
        send_shares(source, _order(source, torch.float16), TrainerRanks(None), deliver=sent.append, timeout_s=10)
    assert sent == []
