"""plan / pack / unpack: bit-exact round trips for every dtype and awkward shape."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_threads import torch_threads
from weightsync.bucketing import pack, plan_buckets, unpack
from weightsync.integrity import byte_view
from weightsync.manifest import TensorMeta
from weightsync.push.packer import pack_stream, stream_order

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


def _pack_one_by_one(plan: list, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The reference: every tensor through `pack_one`, one call each."""
    from weightsync.bucketing import allocate, pack_one

    out = []
    for bucket in plan:
        buffer = allocate(bucket)
        for entry in bucket.entries:
            pack_one(buffer, entry, tensors[entry.hf_name], allow_overflow=True)
        out.append(buffer)
    return out


def _moe_like(seed: int = 0) -> dict[str, torch.Tensor]:
    """Experts sliced out of fused 3-D tensors (`w[e]`, `w[e, :I]`, `w[e, I:]`: contiguous
    views at an offset), a transposed one, mixed dtypes, 0-d, empty, and one larger than a run."""
    from weightsync.push.packer import LARGE_BYTES

    gen = torch.Generator().manual_seed(seed)
    experts, inter, hidden = 6, 8, 12
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen)
    down = torch.randn(experts, hidden, inter, generator=gen)
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(10, hidden, generator=gen)}
    for e in range(experts):
        tensors[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
        tensors[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = gate_up[e, inter:]
        tensors[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = down[e]
    tensors["model.layers.0.mlp.gate.weight"] = torch.randn(hidden, experts, generator=gen).t()  # non-contiguous
    tensors["model.layers.0.mlp.gate.e_score_correction_bias"] = torch.randn(experts, generator=gen).to(torch.bfloat16)
    tensors["model.layers.0.input_layernorm.weight"] = torch.randn(hidden, generator=gen).to(torch.bfloat16)
    tensors["model.layers.0.step"] = torch.tensor(7, dtype=torch.int64)
    tensors["model.layers.0.mask"] = torch.tensor([True, False, True])
    tensors["model.layers.0.empty"] = torch.zeros(0, 4)
    tensors["model.layers.0.scale"] = torch.tensor(0.5)
    tensors["lm_head.weight"] = torch.randn(LARGE_BYTES // 4 + 3, generator=gen)  # copied on its own
    return tensors


@pytest.mark.parametrize("bucket_bytes", [64, 1000, 4096, 1 << 30])
@pytest.mark.parametrize("cast", [None, torch.bfloat16, torch.float16])
def test_runs_pack_exactly_what_pack_one_packs(bucket_bytes: int, cast: torch.dtype | None) -> None:
    """pack_stream copies runs of small tensors with one call; the bytes are pack_one's,
    bit for bit, at every bucket boundary, for views of fused expert tensors, mixed
    dtypes and a float32 -> bfloat16/float16 cast in the stream."""
    tensors = _moe_like()
    metas = [TensorMeta(hf_name=n, dtype=cast if cast is not None and t.is_floating_point() else t.dtype,
                        shape=tuple(t.shape)) for n, t in tensors.items()]
    plan = list(plan_buckets(metas, bucket_bytes))
    got = [buf for _, buf in pack_stream(plan, ((n, tensors[n]) for n in stream_order(plan)), allow_overflow=True)]
    want = _pack_one_by_one(plan, tensors)
    assert len(got) == len(want) == len(plan)
    for g, w in zip(got, want, strict=True):
        assert g is not None and torch.equal(g, w)


def test_runs_respect_their_limits_and_the_buffer_given() -> None:
    """Thousands of tiny tensors (more than a run holds) land in place in a buffer that is
    larger than the bucket (a shared-memory slot), and nothing past the bucket is written."""
    from weightsync.push.packer import RUN_MAX_TENSORS

    gen = torch.Generator().manual_seed(1)
    tensors = {f"model.layers.{i // 128}.mlp.experts.{i % 128}.w": torch.randn(3, 2, generator=gen)
               for i in range(3 * RUN_MAX_TENSORS + 5)}
    plan = list(plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 20))
    slot = torch.full((plan[0].nbytes + 16,), 0xAB, dtype=torch.uint8)
    (bucket, buffer), = pack_stream(plan, ((n, tensors[n]) for n in stream_order(plan)), alloc=lambda _: slot)
    assert buffer is not None and torch.equal(buffer, _pack_one_by_one(plan, tensors)[0])
    assert bool((slot[bucket.nbytes:] == 0xAB).all())


def test_a_run_checks_every_tensor_against_the_plan() -> None:
    tensors = {f"e{i}": torch.randn(4) for i in range(6)}
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 20)
    tensors["e3"] = torch.randn(5)
    with pytest.raises(ValueError, match=r"'e3' is \(5,\) torch.float32, the plan says \(4,\)"):
        list(pack_stream(plan, ((n, tensors[n]) for n in stream_order(plan))))


def test_an_overflow_inside_a_run_names_its_tensor() -> None:
    from weightsync.errors import CastError

    tensors = {f"e{i}": torch.ones(4) for i in range(6)}
    tensors["e4"] = torch.tensor([1.0, 2.0, 1e6, 3.0])
    plan = plan_buckets([TensorMeta(hf_name=n, dtype=torch.float16, shape=(4,)) for n in tensors], 1 << 20)
    with pytest.raises(CastError, match=r"'e4' from torch.float32 to torch.float16 overflows"):
        list(pack_stream(plan, ((n, tensors[n]) for n in stream_order(plan))))


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 30])
def test_bucket_views_are_the_entry_views(bucket_bytes: int) -> None:
    from weightsync.bucketing import bucket_views, entry_view

    tensors = _moe_like(seed=2)
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], bucket_bytes)
    for bucket, buffer in pack_stream(plan, ((n, tensors[n]) for n in stream_order(plan))):
        assert buffer is not None
        views = bucket_views(buffer, bucket)
        assert len(views) == len(bucket.entries)
        for view, entry in zip(views, bucket.entries, strict=True):
            want = entry_view(buffer, entry)
            assert view.dtype == want.dtype and view.shape == want.shape
            assert view.data_ptr() == want.data_ptr() and torch.equal(view, want)
            assert torch.equal(view, tensors[entry.hf_name])
    with pytest.raises(ValueError, match="expected a 1-d uint8 buffer"):
        bucket_views(torch.zeros(3, dtype=torch.uint8), plan[0])


def test_a_run_whose_tensors_differ_from_its_plan_packs_one_by_one() -> None:
    """A run is laid out from the plan's entries; its tensors are checked together when
    they arrive. One of another source dtype (cast to the same entry dtype), one not
    contiguous and one a view at an offset, all inside one run: the bytes are pack_one's."""
    gen = torch.Generator().manual_seed(3)
    tensors = {f"e{i}": torch.randn(4, 6, generator=gen) for i in range(12)}
    tensors["e3"] = tensors["e3"].to(torch.bfloat16)
    tensors["e6"] = torch.randn(6, 4, generator=gen).t()
    tensors["e9"] = torch.randn(3, 4, 6, generator=gen)[1]
    metas = [TensorMeta(hf_name=n, dtype=torch.bfloat16, shape=(4, 6)) for n in tensors]
    plan = list(plan_buckets(metas, 1 << 20))
    (_, got), = pack_stream(plan, ((n, tensors[n]) for n in stream_order(plan)))
    assert got is not None and torch.equal(got, _pack_one_by_one(plan, tensors)[0])


def test_parts_inside_a_run_are_read_before_the_next_tensor() -> None:
    """A tensor given as its parts (`TensorParts`) between small tensors of one run: its
    parts are read before the stream is asked for the next tensor, and the bytes are those
    of the whole tensor packed with pack_one."""
    from weightsync.bucketing import TensorParts

    gen = torch.Generator().manual_seed(4)
    tensors = {f"e{i}": torch.randn(2, 3, 4, generator=gen) for i in range(6)}
    plan = list(plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 20))
    read: list[str] = []

    def parts(name: str):  # type: ignore[no-untyped-def]
        for i in range(2):
            read.append(f"{name}[{i}]")
            yield f"{name}[{i}]", tensors[name][i]

    def stream():  # type: ignore[no-untyped-def]
        for name in stream_order(plan):
            read.append(name)
            yield name, TensorParts(parts(name), shape=(2, 3, 4), part_shape=(3, 4)) if name == "e2" else tensors[name]

    (_, got), = pack_stream(plan, stream())
    assert got is not None and torch.equal(got, _pack_one_by_one(plan, tensors)[0])
    assert read == ["e0", "e1", "e2", "e2[0]", "e2[1]", "e3", "e4", "e5"]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cast", [None, torch.bfloat16])
def test_runs_shared_with_the_helper_thread_are_pack_ones_bytes(threads: int, cast: torch.dtype | None) -> None:
    """With torch's threads above one, runs and small tensors go to a helper thread when it is
    free and are copied here when it is busy; large tensors here on all threads once it is
    done. Every bucket's bytes are pack_one's, a cast included, with one thread or two, for
    runs cut at RUN_MAX_BYTES and tensors at LARGE_BYTES."""
    from weightsync.push.packer import LARGE_BYTES, RUN_MAX_BYTES

    gen = torch.Generator().manual_seed(5)
    tensors = {f"e{i}": torch.randn(61, 67, generator=gen) for i in range(RUN_MAX_BYTES // (61 * 67 * 4) + 9)}
    tensors["big"] = torch.randn(LARGE_BYTES // 4 + 1, generator=gen)
    tensors.update({f"f{i}": torch.randn(3, 5, generator=gen) for i in range(40)})
    tensors["odd"] = torch.randn(7, 9, generator=gen).t()  # packed on its own
    metas = [TensorMeta(hf_name=n, dtype=cast or t.dtype, shape=tuple(t.shape)) for n, t in tensors.items()]
    for bucket_bytes in (1 << 30, 3 << 20):
        plan = list(plan_buckets(metas, bucket_bytes))
        with torch_threads(threads):
            got = [buf for _, buf in pack_stream(plan, ((n, tensors[n]) for n in stream_order(plan)))]
        want = _pack_one_by_one(plan, tensors)
        assert len(got) == len(want) == len(plan)
        for g, w in zip(got, want, strict=True):
            assert g is not None and torch.equal(g, w)


def test_a_stream_that_fails_leaves_no_copy_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the stream fails while the helper thread copies a run into the bucket, pack_stream
    raises only once that copy is done: a caller that reuses the buffer (a shared-memory slot)
    finds no write still landing in it. The helper's copy is slowed down to show it."""
    from weightsync.push import packer

    done: list[str] = []
    copy = packer._copy_run

    def slow(buffer: torch.Tensor, entries: list, tensors: list, *, allow_overflow: bool) -> None:
        time.sleep(0.3)
        copy(buffer, entries, tensors, allow_overflow=allow_overflow)
        done.append(entries[-1].hf_name)

    monkeypatch.setattr(packer, "_copy_run", slow)
    tensors = {f"e{i}": torch.randn(4, 4) for i in range(8)}
    tensors["late"] = torch.arange(3, dtype=torch.int16)  # after the run, in the same bucket
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 20)
    assert len(plan) == 1 and stream_order(plan)[-1] == "late"

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        yield from ((n, tensors[n]) for n in stream_order(plan)[:-1])
        raise RuntimeError("the trainer's gather failed")

    with torch_threads(2), pytest.raises(RuntimeError, match="gather failed"):
        list(pack_stream(plan, stream()))
    assert done == ["e7"]
