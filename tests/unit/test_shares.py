"""Buckets in shares (`weightsync.formats.shares`): an engine assembles a bucket from its trainer
ranks' shares only when they tile it exactly, each share checked before a byte is used,
and the frame header carries a share through `wire` unchanged."""

from __future__ import annotations

import pytest
import torch

from weightsync.digests import WSMIX64, combine_wsmix64, digest, wsmix64_part
from weightsync.errors import IntegrityError
from weightsync.formats.shares import Assembly, Share, merge_ranges
from weightsync.formats.wire import FrameHeader, decode_frame, encode_prefix

NBYTES = 1000


def _bucket() -> torch.Tensor:
    return torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def _share(bucket: torch.Tensor, ranges: list[tuple[int, int]], index: int = 0, version: int = 1) -> Share:
    data = torch.cat([bucket[o:o + n] for o, n in ranges]) if ranges else torch.empty(0, dtype=torch.uint8)
    return Share(version=version, index=index, digest=digest(bucket, WSMIX64), ranges=tuple(ranges), data=data)


def _add(assembly: Assembly, share: Share, *, payload: bytes | None = None) -> torch.Tensor | None:
    raw = payload if payload is not None else b"".join(bytes(p) for p in share.payload())
    return assembly.add(version=share.version, index=share.index, nbytes=NBYTES, whole_digest=share.digest,
                        num_ranges=len(share.ranges), share_digest=share.payload_digest(), payload=memoryview(raw),
                        alloc=lambda n: torch.zeros(n, dtype=torch.uint8))


# rows of three tensors split between two ranks, as FSDP2 splits dim 0
RANK0 = [(0, 100), (300, 150), (700, 150)]
RANK1 = [(100, 200), (450, 250), (850, 150)]


def test_shares_that_tile_the_bucket_assemble_it_byte_for_byte_in_any_order() -> None:
    bucket = _bucket()
    for first, second in ((RANK0, RANK1), (RANK1, RANK0)):
        assembly = Assembly()
        assert _add(assembly, _share(bucket, first)) is None
        assert assembly.pending() == [(1, 0)]
        whole = _add(assembly, _share(bucket, second))
        assert whole is not None and torch.equal(whole, bucket)
        assert assembly.pending() == []


def test_the_whole_digest_combines_from_each_ranks_parts() -> None:
    bucket = _bucket()
    parts = [wsmix64_part(bucket[o:o + n], o) for o, n in merge_ranges(RANK0) + merge_ranges(RANK1)]
    assert combine_wsmix64(parts, NBYTES) == digest(bucket, WSMIX64)


def test_a_share_corrupted_in_transit_is_refused_before_it_is_used() -> None:
    bucket = _bucket()
    share = _share(bucket, RANK0)
    raw = bytearray(b"".join(bytes(p) for p in share.payload()))
    raw[-1] ^= 1
    assembly = Assembly()
    with pytest.raises(IntegrityError, match=r"bucket 0 of v1: digest \w+ != sent \w+ \(corrupted in transit\)"):
        _add(assembly, share, payload=bytes(raw))
    assert assembly.pending() == [], "nothing of it was taken"


@pytest.mark.parametrize(("shares", "why"), [
    ([[*RANK1[:2], (840, 160)]], "shares fill 1010 of its 1000 bytes .overlapping shares"),
    ([[*RANK1[:2], (860, 140)], [(0, 10)]], "bytes 0..10 are in two shares"),
    ([[*RANK1[:2], (850, 160)]], r"range\(s\) \[\(850, 160\)\] outside the bucket's 1000 bytes"),
])
def test_shares_that_do_not_tile_the_bucket_are_refused(shares: list[list[tuple[int, int]]], why: str) -> None:
    padded = torch.cat([_bucket(), torch.zeros(100, dtype=torch.uint8)])
    assembly = Assembly()
    _add(assembly, _share(padded, RANK0))
    with pytest.raises(IntegrityError, match=why):
        for ranges in shares:
            _add(assembly, _share(padded, ranges))


def test_an_older_versions_partial_buckets_are_dropped_when_a_newer_one_arrives() -> None:
    bucket = _bucket()
    assembly = Assembly()
    _add(assembly, _share(bucket, RANK0, version=1))
    _add(assembly, _share(bucket, RANK0, version=2))
    assert assembly.pending() == [(2, 0)]
    assembly.drop(2)
    assert assembly.pending() == []


def test_merge_ranges_joins_touching_ranges_and_drops_empty_ones() -> None:
    assert merge_ranges([(0, 10), (10, 5), (15, 0), (20, 4)]) == ((0, 15), (20, 4))


def test_a_share_frame_header_round_trips_and_a_whole_bucket_header_is_unchanged() -> None:
    share = FrameHeader(version=3, index=2, nbytes=48, digest="ab" * 8, forward=("http://x",), share_ranges=2,
                        share_digest="cd" * 8)
    header, payload = decode_frame(encode_prefix(share) + bytes(48))
    assert header == share and header.is_share and len(payload) == 48
    whole = FrameHeader(version=3, index=2, nbytes=4, digest="ab" * 8)
    assert "share" not in whole.to_dict() and not decode_frame(encode_prefix(whole) + bytes(4))[0].is_share
