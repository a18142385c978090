"""plan / pack / unpack: bit-exact round trips for every dtype and awkward shape."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.bucketing import pack, pack_stream, plan_buckets, stream_order, unpack
from weightsync.integrity import byte_view
from weightsync.types import TensorMeta

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.uint16, torch.uint32, torch.uint64, torch.bool,
]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes reinterpreted as `dtype` (covers NaN payloads and every bit pattern)."""
    gen = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(byte_view(a.contiguous()), byte_view(b.contiguous()))
    )


def roundtrip(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> None:
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], bucket_bytes)
    assert [n for b in plan for n in b.hf_names] != [] or not tensors
    assert sorted(n for b in plan for n in b.hf_names) == sorted(tensors)
    for bucket in plan:
        buf = pack(bucket, {n: tensors[n] for n in bucket.hf_names})
        assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() == bucket.nbytes
        items = [e.dtype.itemsize for e in bucket.entries]
        assert items == sorted(items, reverse=True), "descending itemsize"
        for e in bucket.entries:
            assert e.offset % e.dtype.itemsize == 0
        for copy in (False, True):
            for name, t in unpack(buf, bucket, copy=copy):
                assert same_bytes(t, tensors[name]), name


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(st.tuples(shapes, st.sampled_from(DTYPES), st.booleans()), min_size=1, max_size=12),
    bucket_bytes=st.integers(1, 400),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_is_bit_exact(specs: list, bucket_bytes: int, seed: int) -> None:
    tensors = {}
    for i, (shape, dtype, transpose) in enumerate(specs):
        t = random_tensor(shape, dtype, seed + i)
        if transpose and t.dim() >= 2:
            t = t.transpose(0, -1)  # non-contiguous
        tensors[f"t{i}.weight"] = t
    roundtrip(tensors, bucket_bytes)


def test_awkward_tensors() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "zero_d_bf16": torch.tensor(3.25, dtype=torch.bfloat16),
        "empty": torch.empty(0, 7, dtype=torch.float16),
        "strided": base[:, ::2],
        "transposed": base.t(),
        "expanded": torch.ones(1, 3).expand(4, 3),
        "bool": torch.tensor([[True, False], [False, True]]),
        "fp8": torch.linspace(-2, 2, 9).to(torch.float8_e4m3fn),
        "big": torch.randn(1000),  # larger than the bucket: gets a bucket of its own
    }
    roundtrip(tensors, bucket_bytes=64)
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], 64)
    (own,) = [b for b in plan if "big" in b.hf_names]
    assert own.hf_names == ("big",) and own.nbytes == 4000


def test_plan_is_deterministic_and_keeps_module_order() -> None:
    metas = [TensorMeta(hf_name=f"w{i}", dtype=torch.float32, shape=(10,)) for i in range(10)]
    a = plan_buckets(metas, 100)
    assert a == plan_buckets(list(metas), 100)
    assert [b.hf_names for b in a] == [("w0", "w1"), ("w2", "w3"), ("w4", "w5"), ("w6", "w7"), ("w8", "w9")]


def test_itemsize_order_is_stable_within_a_bucket() -> None:
    metas = [
        TensorMeta(hf_name="a8", dtype=torch.int8, shape=(3,)),
        TensorMeta(hf_name="b32", dtype=torch.float32, shape=(1,)),
        TensorMeta(hf_name="c16", dtype=torch.bfloat16, shape=(1,)),
        TensorMeta(hf_name="d32", dtype=torch.int32, shape=(1,)),
    ]
    (bucket,) = plan_buckets(metas, 1 << 10)
    assert bucket.hf_names == ("b32", "d32", "c16", "a8")
    assert [e.offset for e in bucket.entries] == [0, 4, 8, 10]


def test_errors_name_the_offender() -> None:
    meta = TensorMeta(hf_name="w", dtype=torch.float32, shape=(2,))
    with pytest.raises(ValueError, match="listed twice"):
        plan_buckets([meta, meta], 100)
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([meta], 0)
    (bucket,) = plan_buckets([meta], 100)
    with pytest.raises(ValueError, match=r"'w' is \(3,\) torch.float32, the plan says \(2,\)"):
        pack(bucket, {"w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"missing tensors \['w'\]"):
        pack(bucket, {"v": torch.zeros(2)})
    with pytest.raises(ValueError, match="expected 8"):
        unpack(torch.zeros(7, dtype=torch.uint8), bucket)


def test_pack_into_a_larger_preallocated_buffer() -> None:
    t = {"a": torch.randn(3), "b": torch.randn(2).to(torch.float16)}
    (bucket,) = plan_buckets([TensorMeta.of(n, v) for n, v in t.items()], 1 << 10)
    slot = torch.full((64,), 0xAB, dtype=torch.uint8)
    packed = pack(bucket, t, out=slot)
    assert packed.data_ptr() == slot.data_ptr() and packed.numel() == 16
    assert torch.equal(slot[16:], torch.full((48,), 0xAB, dtype=torch.uint8))
    assert all(same_bytes(v, t[n]) for n, v in unpack(packed, bucket))


def test_unpack_views_alias_the_buffer_and_copies_do_not() -> None:
    t = {"a": torch.ones(4)}
    (bucket,) = plan_buckets([TensorMeta.of("a", t["a"])], 1 << 10)
    buf = pack(bucket, t)
    (_, view), = unpack(buf, bucket)
    (_, copy), = unpack(buf, bucket, copy=True)
    buf.zero_()
    assert torch.equal(view, torch.zeros(4)) and torch.equal(copy, torch.ones(4))


def test_pack_stream_holds_one_bucket_and_checks_order() -> None:
    tensors = {f"w{i}": torch.full((8,), float(i)) for i in range(5)}
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], 64)
    order = stream_order(plan)
    out = list(pack_stream(plan, ((n, tensors[n]) for n in order)))
    assert [b.index for b, _ in out] == [b.index for b in plan]
    for bucket, buf in out:
        assert buf is not None
        assert all(torch.equal(t, tensors[n]) for n, t in unpack(buf, bucket))
    assert [buf for _, buf in pack_stream(plan, ((n, tensors[n]) for n in order), keep=False)] == [None] * len(plan)
    with pytest.raises(ValueError, match="out of order"):
        list(pack_stream(plan, ((n, tensors[n]) for n in reversed(order))))
    with pytest.raises(ValueError, match="ended before"):
        list(pack_stream(plan, iter([])))


FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@settings(max_examples=200, deadline=None)
@given(src=st.sampled_from(FLOATS[:4]), dst=st.sampled_from(FLOATS), numel=st.integers(0, 3000),
       seed=st.integers(0, 2**31 - 1))
def test_packing_casts_exactly_like_to(src: torch.dtype, dst: torch.dtype, numel: int, seed: int) -> None:
    """Every bit pattern of the source (NaN payloads, infinities, subnormals, rounding
    ties) lands in the bucket as `tensor.to(dst)` would give it, bit for bit."""
    tensor = random_tensor((numel,), src, seed)
    plan = plan_buckets([TensorMeta(hf_name="w", dtype=dst, shape=(numel,))], 1 << 20)
    (bucket, buffer), = pack_stream(plan, [("w", tensor)], allow_overflow=True)
    assert buffer is not None
    got = unpack(buffer, bucket)[0][1]
    want = tensor.to(dst)
    assert torch.equal(byte_view(got.contiguous()), byte_view(want.contiguous()))


def test_integers_and_bools_are_never_cast() -> None:
    for src, dst in ((torch.int32, torch.int64), (torch.bool, torch.uint8), (torch.int64, torch.float32),
                     (torch.float32, torch.int32), (torch.complex64, torch.float32)):
        plan = plan_buckets([TensorMeta(hf_name="ids", dtype=dst, shape=(4,))], 1 << 10)
        with pytest.raises(ValueError, match=r"'ids' is \(4,\) torch\.\w+, the plan says"):
            list(pack_stream(plan, [("ids", torch.zeros(4, dtype=src))]))


def test_a_cast_that_overflows_names_the_tensor_unless_allowed() -> None:
    from weightsync.errors import CastError

    big = torch.tensor([1.0, -7e4, 3.0])  # beyond float16's 65504
    plan = plan_buckets([TensorMeta(hf_name="model.norm.weight", dtype=torch.float16, shape=(3,))], 1 << 10)
    with pytest.raises(CastError, match=r"'model\.norm\.weight' from torch\.float32 to torch\.float16 overflows: "
                                        r"1 value\(s\) up to 7e\+04"):
        list(pack_stream(plan, [("model.norm.weight", big)]))
    (bucket, buffer), = pack_stream(plan, [("model.norm.weight", big)], allow_overflow=True)
    assert buffer is not None and torch.isinf(unpack(buffer, bucket)[0][1][1])
    # infinities the trainer already had are not an overflow
    (_, buffer), = pack_stream(plan, [("model.norm.weight", torch.tensor([1.0, float("-inf"), float("nan")]))])
    assert buffer is not None
