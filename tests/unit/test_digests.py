"""weightsync.digests: wsmix64 against its pure-Python definition, and what it catches.

Property tests (hypothesis) over sizes (0 bytes, 1-7, odd, several chunks), dtype
views and corruptions. The torch code is the one CUDA runs (int64 ops, an exact
sum), so agreeing with `reference_wsmix64` on CPU is agreeing on the GPU.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import weightsync.digests as digests
from weightsync.digests import (
    FUSED_CHUNK_BYTES,
    WSMIX64,
    XXH3_64,
    Wsmix64,
    combine_wsmix64,
    copy_hashed,
    digest,
    for_device,
    reference_wsmix64,
    wsmix64_part,
)
from weightsync.integrity import BucketHasher

small = st.binary(min_size=0, max_size=200)
fast = settings(max_examples=200, deadline=None)


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def wsmix(data: bytes) -> str:
    return digest(as_tensor(data), WSMIX64)


@fast
@given(small)
def test_torch_equals_the_pure_python_definition(data: bytes) -> None:
    assert wsmix(data) == reference_wsmix64(data) == digest(data, WSMIX64)


def test_edge_sizes_and_known_values() -> None:
    for n in [*range(0, 18), 63, 64, 65, 1001]:
        data = bytes((7 * i + 3) % 256 for i in range(n))
        assert wsmix(data) == reference_wsmix64(data), n
    assert len({wsmix(b"\0" * n) for n in range(0, 40)}) == 40, "zero runs of every length differ"
    # pinned: a change of the definition changes every manifest's digests
    assert reference_wsmix64(b"") == "d101f6887f28d12d"
    assert reference_wsmix64(b"weightsync") == "faa6cba551d68b7d"


@settings(max_examples=25, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.integers(1, 9), st.integers(0, 2**32))
def test_chunked_and_fed_in_pieces_equals_one_shot(data: bytes, chunk_words: int, seed: int) -> None:
    """Any chunk size and any split into tensors (misaligned ones included) give the
    one-shot digest: the sum is exact and the pending tail carries across updates."""
    saved = dict(digests.CHUNK_WORDS)
    digests.CHUNK_WORDS.update(cpu=chunk_words, other=chunk_words)
    try:
        gen = torch.Generator().manual_seed(seed)
        whole = as_tensor(data)
        hasher = Wsmix64()
        at = 0
        while at < len(data):
            step = int(torch.randint(1, 13, (), generator=gen))
            hasher.update(whole[at:at + step])
            at += step
        assert hasher.hexdigest() == wsmix(data) == reference_wsmix64(data)
    finally:
        digests.CHUNK_WORDS.update(saved)


@settings(max_examples=25, deadline=None)
@given(st.binary(min_size=0, max_size=400).map(lambda b: b[: len(b) // 8 * 8]), st.integers(0, 2**40))
def test_the_device_ops_equal_the_host_ops(data: bytes, first_word: int) -> None:
    """The torch ops a device runs (here on the CPU) give the host's numpy sum, bit for bit."""
    tensor = as_tensor(data)
    device = int(digests._mix_device(tensor, first_word)) & digests.MASK64
    assert device == digests._mix_host(tensor.numpy(), first_word)


def test_large_buffers_span_many_chunks() -> None:
    """5 MiB: several 1 MiB CPU chunks and a tail; an unaligned start copies per chunk."""
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (5 * (1 << 20) + 5,), dtype=torch.uint8, generator=gen)
    one = digest(data, WSMIX64)
    saved = dict(digests.CHUNK_WORDS)
    digests.CHUNK_WORDS.update(cpu=3 << 20)
    try:
        assert digest(data, WSMIX64) == one
    finally:
        digests.CHUNK_WORDS.update(saved)
    shifted = torch.empty(data.numel() + 3, dtype=torch.uint8)
    shifted[3:] = data
    assert digest(shifted[3:], WSMIX64) == one, "same bytes at an unaligned offset"
    flipped = data.clone()
    flipped[3 << 20] ^= 0x10
    assert digest(flipped, WSMIX64) != one


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.float64, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 3, 7, 1000])
def test_same_bytes_same_digest_whatever_the_dtype(dtype: torch.dtype, numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    tensor = (torch.randn(numel, generator=gen) * 10).to(dtype)
    raw = tensor.view(torch.uint8).reshape(-1) if numel else torch.empty(0, dtype=torch.uint8)
    assert digest(tensor, WSMIX64) == digest(raw, WSMIX64) == reference_wsmix64(bytes(raw.tolist()))
    assert digest(tensor.reshape(1, -1), WSMIX64) == digest(tensor, WSMIX64), "shape is not hashed, bytes are"
    if numel > 1:  # a non-contiguous tensor is hashed as its contiguous copy
        strided = torch.stack([tensor, tensor], 1)[:, 0]
        assert digest(strided, WSMIX64) == digest(tensor, WSMIX64)


@settings(max_examples=40, deadline=None)
@given(st.binary(min_size=1, max_size=48))
def test_every_single_bit_flip_is_caught(data: bytes) -> None:
    clean = wsmix(data)
    for bit in range(8 * len(data)):
        corrupted = bytearray(data)
        corrupted[bit // 8] ^= 1 << (bit % 8)
        assert wsmix(bytes(corrupted)) != clean, f"bit {bit} of {len(data)} bytes"


@fast
@given(st.binary(min_size=8, max_size=256), st.sampled_from([4, 8]), st.data())
def test_swapped_blocks_are_caught(data: bytes, block: int, draw: st.DataObject) -> None:
    count = len(data) // block
    if count < 2:
        return
    i, j = draw.draw(st.lists(st.integers(0, count - 1), min_size=2, max_size=2, unique=True))
    a, b = data[i * block:(i + 1) * block], data[j * block:(j + 1) * block]
    if a == b:
        return  # swapping equal blocks changes nothing
    swapped = bytearray(data)
    swapped[i * block:(i + 1) * block], swapped[j * block:(j + 1) * block] = b, a
    assert wsmix(bytes(swapped)) != wsmix(data)


@fast
@given(st.lists(st.binary(min_size=1, max_size=40), min_size=2, max_size=5, unique=True), st.data())
def test_tensors_swapped_or_shifted_inside_a_bucket_are_caught(parts: list[bytes], draw: st.DataObject) -> None:
    bucket = b"".join(parts)
    order = draw.draw(st.permutations(range(len(parts))))
    reordered = b"".join(parts[k] for k in order)
    if reordered != bucket:
        assert wsmix(reordered) != wsmix(bucket)
    shift = draw.draw(st.integers(1, 7))
    moved = b"\0" * shift + bucket[:-shift]  # same length, every tensor shifted
    if moved != bucket:
        assert wsmix(moved) != wsmix(bucket)


@fast
@given(st.binary(min_size=1, max_size=200), st.data())
def test_truncation_and_padding_are_caught(data: bytes, draw: st.DataObject) -> None:
    cut = draw.draw(st.integers(0, len(data) - 1))
    assert wsmix(data[:cut]) != wsmix(data)
    pad = draw.draw(st.integers(1, 16))
    assert wsmix(data + b"\0" * pad) != wsmix(data)


def test_bucket_hasher_runs_the_named_algorithm() -> None:
    tensors = [torch.arange(3, dtype=torch.bfloat16), torch.ones(5), torch.tensor(7, dtype=torch.int8)]
    packed = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
    for algorithm in (XXH3_64, WSMIX64):
        hasher = BucketHasher(algorithm)
        for t in tensors:
            hasher.update(t)
        assert hasher.hexdigest() == digest(packed, algorithm)
    assert digest(packed, XXH3_64) != digest(packed, WSMIX64)
    with pytest.raises(ValueError, match="unknown digest algorithm 'md5'; this side computes xxh3_64, wsmix64"):
        BucketHasher("md5")


def test_the_sender_hashes_device_buffers_in_place_and_cpu_buffers_with_xxh3() -> None:
    assert for_device("cpu") == XXH3_64
    assert for_device("cuda:0") == WSMIX64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_and_cpu_give_the_same_digest() -> None:
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (3 * (1 << 20) + 5,), dtype=torch.uint8, generator=gen)
    assert digest(data.cuda(), WSMIX64) == digest(data, WSMIX64)


@pytest.mark.parametrize("algorithm", ["xxh3_64", "wsmix64"])
@pytest.mark.parametrize("nbytes", [0, 1, FUSED_CHUNK_BYTES - 3, FUSED_CHUNK_BYTES, 2 * FUSED_CHUNK_BYTES + 5])
def test_copy_hashed_copies_and_hashes_the_bytes_written(algorithm: str, nbytes: int) -> None:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    dst = torch.full((nbytes,), 7, dtype=torch.uint8)
    assert copy_hashed(dst, src, algorithm) == digest(src, algorithm)
    assert torch.equal(dst, src)


def test_copy_hashed_refuses_mismatched_buffers() -> None:
    with pytest.raises(ValueError, match="equal 1-d uint8"):
        copy_hashed(torch.empty(4, dtype=torch.uint8), torch.empty(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="equal 1-d uint8"):
        copy_hashed(torch.empty(4, dtype=torch.uint8), torch.empty(1, dtype=torch.float32))


def test_wsmix64_parts_combine_to_the_whole_digest() -> None:
    """Pieces cut anywhere (inside words, empty, one byte) combine to the digest of the
    whole: what ranks holding a tensor's rows (FSDP2) contribute."""
    rng = random.Random(3)
    for _ in range(300):
        n = rng.randrange(0, 70)
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
        cuts = sorted(rng.randrange(0, n + 1) for _ in range(rng.randrange(0, 4)))
        bounds = [0, *cuts, n]
        parts = [wsmix64_part(data[a:b], a) for a, b in itertools.pairwise(bounds)]
        assert combine_wsmix64(parts, n) == digest(data, WSMIX64) == reference_wsmix64(bytes(data.numpy())), bounds
    whole = torch.arange(40, dtype=torch.uint8)
    parts = [wsmix64_part(whole[:13], 0), wsmix64_part(whole[13:], 13)]
    assert combine_wsmix64(parts[:1], 40) != digest(whole, WSMIX64), "a missing piece changes the digest"
