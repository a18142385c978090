"""The sparse encodings (`weightsync.change_encoding`): each one chosen where it is the smallest,
applied bit for bit, pinned byte for byte, and malformed payloads refused."""

from __future__ import annotations

import pytest
import torch

from weightsync.change_encoding import Changes, apply_payload, encode, encode_positions, encoded_nbytes
from weightsync.errors import IntegrityError, ManifestError
from weightsync.manifest import BucketMeta, Manifest, TensorEntry


def _changed(base: torch.Tensor, positions: list[int]) -> torch.Tensor:
    new = base.clone()
    flat = new.view(-1)
    for p in positions:
        flat[p] = flat[p] + 1
    return new


def _roundtrip(new: torch.Tensor, base: torch.Tensor) -> str:
    enc = encode(new, base)
    if enc.payload is None:
        return enc.encoding
    assert enc.payload.numel() == encoded_nbytes(enc.encoding, new.numel(), new.dtype.itemsize, enc.num_changed)
    got = apply_payload(base, encoding=enc.encoding, num_changed=enc.num_changed, payload=enc.payload)
    assert torch.equal(got.view(torch.int16), new.view(torch.int16)), "bit for bit"
    assert not torch.equal(got, base) or torch.equal(new, base)
    return enc.encoding


def test_each_encoding_is_chosen_where_it_is_smallest_and_applies_bit_exact() -> None:
    torch.manual_seed(0)
    base = torch.randn(128, 1024).to(torch.bfloat16)
    assert _roundtrip(_changed(base, [3, 70, 5000]), base) == "positions16"
    assert _roundtrip(_changed(base, [0, 65535 + 10, 65535 + 11]), base) == "positions32"  # a gap past 16 bits
    every_tenth = list(range(0, base.numel(), 10))  # 10%: bitmap (1/8 byte each + values) beats 4 bytes each
    assert _roundtrip(_changed(base, every_tenth), base) == "bitmap"
    assert _roundtrip(base + 1, base) == "dense"


def test_encoding_gathered_positions_gives_the_same_payload_as_encoding_the_tensor() -> None:
    """What a sharded trainer's sender encodes from the ranks' gathered changes is byte
    for byte what `encode` gives for the whole tensor, in every encoding."""
    torch.manual_seed(1)
    base = torch.randn(128, 1024).to(torch.bfloat16)
    for positions in ([3, 70, 5000], [0, 65535 + 10, 65535 + 11], list(range(0, base.numel(), 10))):
        new = _changed(base, positions)
        changes = Changes(new, base)
        assert changes.positions().tolist() == positions
        whole = encode(new, base)
        gathered = encode_positions(base.numel(), 2, changes.positions(), changes.values())
        assert (gathered.encoding, gathered.num_changed) == (whole.encoding, whole.num_changed)
        assert whole.payload is not None and gathered.payload is not None
        assert torch.equal(gathered.payload, whole.payload), whole.encoding


def test_bitwise_comparison_sees_signed_zeros_and_nan_payloads() -> None:
    base = torch.tensor([0.0, float("nan"), 1.0] * 100, dtype=torch.bfloat16)
    new = base.clone()
    new[0] = -0.0  # == 0.0 numerically, other bytes
    enc = encode(new, base)
    assert enc.num_changed == 1 and enc.encoding == "positions16"
    assert encode(base.clone(), base).num_changed == 0, "NaN equals itself bitwise"


def test_positions16_payload_is_pinned_byte_for_byte() -> None:
    base = torch.zeros(10, dtype=torch.bfloat16)
    new = base.clone()
    new[2], new[7] = 1.0, -2.0
    enc = encode(new, base)
    assert enc.encoding == "positions16" and enc.num_changed == 2 and enc.payload is not None
    # values bf16 1.0 = 0x3f80, -2.0 = 0xc000; gaps 2, 5 (uint16 LE); zero-padded to 8 bytes
    assert enc.payload.tolist() == [0x80, 0x3F, 0x00, 0xC0, 2, 0, 5, 0]


def test_bitmap_payload_is_pinned_byte_for_byte() -> None:
    base = torch.zeros(64, dtype=torch.uint8)
    new = base.clone()
    new[[0, 1, 3, 4, 9, 10, 11]] = 7
    enc = encode(new, base)
    assert enc.encoding == "bitmap" and enc.payload is not None
    # 7 values, then 64 bits: bits 0,1,3,4 of byte 0 (0x1b), 1,2,3 of byte 1 (0x0e); padded to 16
    assert enc.payload.tolist() == [7] * 7 + [0x1B, 0x0E] + [0] * 6 + [0]


@pytest.mark.parametrize("corrupt", ["gap_zero", "past_end", "bitmap_count", "short"])
def test_malformed_payloads_are_refused(corrupt: str) -> None:
    base = torch.zeros(4096, dtype=torch.bfloat16)
    positions = [5, 9, 4000] if corrupt != "bitmap_count" else list(range(0, 4096, 4))
    enc = encode(_changed(base, positions), base)
    assert enc.payload is not None
    payload = enc.payload.clone()
    value_bytes = enc.num_changed * 2
    if corrupt == "gap_zero":
        payload[value_bytes + 2: value_bytes + 4] = 0  # the second position repeats the first
    elif corrupt == "past_end":
        payload[value_bytes + 4: value_bytes + 6] = torch.tensor([0xFF, 0x7F], dtype=torch.uint8)
    elif corrupt == "bitmap_count":
        assert enc.encoding == "bitmap"
        payload[value_bytes] ^= 0x02  # one more element marked than num_changed
    else:
        payload = payload[:-8]
    with pytest.raises(IntegrityError, match="w.0"):
        apply_payload(base, encoding=enc.encoding, num_changed=enc.num_changed, payload=payload, hf_name="w.0")


def test_sparse_manifest_round_trips_and_refuses_what_does_not_fit() -> None:
    entry = TensorEntry(hf_name="w", dtype=torch.bfloat16, shape=(4, 8), offset=0, encoding="bitmap",
                        num_changed=3, tensor_digest="ab" * 8)
    assert entry.nbytes == 3 * 2 + 4 + 6  # values, 32 bits, padding to 8
    manifest = Manifest(version=2, mode="sparse", base_version=1, buckets=(BucketMeta(index=0, entries=(entry,)),))
    assert Manifest.from_json(manifest.to_json()) == manifest
    with pytest.raises(ManifestError, match="sparse encodings travel in 'sparse' manifests only"):
        Manifest.from_dict({**manifest.to_dict(), "mode": "delta"})
    undigested = manifest.to_dict()
    del undigested["buckets"][0]["tensors"][0]["tensor_digest"]
    with pytest.raises(ManifestError, match="needs the tensor_digest"):
        Manifest.from_dict(undigested)
    with pytest.raises(ManifestError, match="needs the base_version"):
        Manifest.from_dict({**manifest.to_dict(), "base_version": None})
    bad = manifest.to_dict()
    bad["buckets"][0]["tensors"][0]["encoding"] = "rle"
    with pytest.raises(ManifestError, match="unknown encoding 'rle'"):
        Manifest.from_dict(bad)
