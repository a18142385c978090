"""Plan, pack and unpack flat buckets. Pure: tensors in, tensors out, no I/O.

A bucket is one contiguous uint8 buffer, its tensors back to back by descending itemsize, no
padding: SGLang's "flattened_bucket" layout byte for byte. The plan is greedy in the source's order
(every rank planning the same metas gets the same plan); a tensor larger than `bucket_bytes` gets a
bucket of its own. Transports and engines move and read the buffers; the pipeline
(`push.pipeline`) and the receiving side call this module. How a stream is packed cheaply per
tensor: docs/PERFORMANCE.md ("Per-tensor cost").
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from weightsync.dtypes import castable
from weightsync.errors import CastError
from weightsync.manifest import BucketMeta, TensorEntry, TensorMeta

RUN_MAX_TENSORS = 256
"""Tensors `pack_stream` copies with one call at most (a run)."""
RUN_MAX_BYTES = 16 << 20
"""Bytes of the tensors a run holds at most before they are copied: a source that
materialises tensors (an FSDP2 gather, a LoRA merge) holds up to twice this much
beyond the tensor in hand (the run it reads, and the one the helper thread copies)."""
LARGE_BYTES = 4 << 20
"""A tensor at least this large is copied on its own, on all of torch's threads."""


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int) -> tuple[BucketMeta, ...]:
    """Group tensors into buckets of at most `bucket_bytes` (oversized ones alone).

    Deterministic: depends only on the order and metadata of `metas`. Within a
    bucket, tensors are stably sorted by descending itemsize.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    current_bytes = 0
    seen: set[str] = set()
    for meta in metas:
        if meta.hf_name in seen:
            raise ValueError(f"tensor {meta.hf_name!r} is listed twice; each name must be sent once")
        seen.add(meta.hf_name)
        if current and current_bytes + meta.nbytes > bucket_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(meta)
        current_bytes += meta.nbytes
    if current:
        groups.append(current)
    return tuple(layout_bucket(i, group) for i, group in enumerate(groups))


def layout_bucket(index: int, metas: Sequence[TensorMeta]) -> BucketMeta:
    """Place `metas` in one bucket: descending itemsize (stable), back to back."""
    ordered = sorted(metas, key=lambda m: -m.itemsize)
    entries = []
    offset = 0
    for m in ordered:
        entries.append(TensorEntry(hf_name=m.hf_name, dtype=m.dtype, shape=m.shape, offset=offset,
                                   encoding=m.encoding, num_changed=m.num_changed, tensor_digest=m.tensor_digest))
        offset += m.nbytes
    return BucketMeta(index=index, entries=tuple(entries))


def entry_view(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The slice of a packed uint8 `buffer` that holds `entry`, typed and shaped.

    A view: it aliases the buffer. A sparse entry's bytes are its payload, not the
    tensor: see `payload_view`.
    """
    if not entry.is_dense:
        raise ValueError(f"{entry.hf_name!r} is {entry.encoding}-encoded; read its payload (payload_view) "
                         "and apply it on top of the base version (weightsync.change_encoding.apply_payload)")
    return payload_view(buffer, entry).view(entry.dtype).view(entry.shape)


def payload_view(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The bytes of `entry` inside a packed uint8 `buffer` (any encoding), as a view."""
    raw = buffer[entry.offset : entry.offset + entry.nbytes]
    if raw.numel() != entry.nbytes:
        raise ValueError(
            f"buffer of {buffer.numel()} bytes is too short for {entry.hf_name!r} "
            f"at offset {entry.offset} ({entry.nbytes} bytes)"
        )
    return raw


def allocate(bucket: BucketMeta, *, device: torch.device | str = "cpu", pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised uint8 buffer sized for `bucket`."""
    return torch.empty(bucket.nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)


def pack_one(buffer: torch.Tensor, entry: TensorEntry, tensor: torch.Tensor, *,
             allow_overflow: bool = False) -> None:
    """Copy one tensor into its place in `buffer` (any layout, any device).

    A floating tensor whose dtype differs from the entry's is cast on the way in,
    exactly as `tensor.to(entry.dtype)` casts (round to nearest even), on the
    device that holds it. A cast to a dtype of smaller range (float32 -> float16)
    raises if a finite value became infinite, unless `allow_overflow`. A sparse entry
    takes its payload: a 1-d uint8 tensor of exactly `entry.nbytes`.
    """
    if not entry.is_dense:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() != entry.nbytes:
            raise ValueError(f"{entry.hf_name!r}: a {entry.encoding} entry takes a 1-d uint8 payload of "
                             f"{entry.nbytes} bytes, got {tuple(tensor.shape)} {tensor.dtype}")
        payload_view(buffer, entry).copy_(tensor)
        return
    _check_fits(entry, tensor)
    if not entry.nbytes:
        return
    view = entry_view(buffer, entry)
    if tensor.dtype == entry.dtype:
        view.copy_(tensor)
        return
    if tensor.device != view.device:
        tensor = tensor.to(entry.dtype)  # cast where the tensor lives, then move the smaller bytes
    view.copy_(tensor)
    check_cast(entry.hf_name, tensor, view, allow_overflow=allow_overflow)


def check_cast(hf_name: str, source: torch.Tensor, cast: torch.Tensor, *, allow_overflow: bool = False) -> None:
    """Raise CastError if casting floating `source` to `cast` turned a finite value into
    +-inf (unless `allow_overflow`, or the cast's dtype has the range of source's)."""
    if allow_overflow or torch.finfo(cast.dtype).max >= torch.finfo(source.dtype).max:
        return
    low, high = torch.aminmax(cast.detach().reshape(-1))
    if torch.isfinite(low) and torch.isfinite(high):
        return  # the common case: one reduction, no allocation
    overflowed = torch.isinf(cast) & torch.isfinite(source.to(cast.device))
    if bool(overflowed.any()):
        worst = float(source.to(cast.device)[overflowed].abs().max())
        raise CastError(
            f"casting {hf_name!r} from {source.dtype} to {cast.dtype} overflows: "
            f"{int(overflowed.sum())} value(s) up to {worst:.4g} exceed {cast.dtype}'s largest "
            f"finite value {torch.finfo(cast.dtype).max:.4g}; send a dtype with more range "
            f"(dtype=torch.bfloat16) or pass allow_overflow=True to accept infinities"
        )


def pack(
    bucket: BucketMeta,
    tensors: Mapping[str, torch.Tensor],
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the tensors of `bucket` into one flat uint8 buffer and return it.

    `tensors` maps hf_name -> tensor and must hold exactly the bucket's names.
    `out`, when given, is a uint8 buffer of at least `bucket.nbytes` (a shared
    memory slot, a pinned buffer); the packed bytes are its first `nbytes`.
    """
    names = set(bucket.hf_names)
    if set(tensors) != names:
        extra = sorted(set(tensors) - names)
        missing = sorted(names - set(tensors))
        raise ValueError(f"bucket {bucket.index}: missing tensors {missing}, unexpected tensors {extra}")
    if out is None:
        out = allocate(bucket, device=next(iter(tensors.values())).device if tensors else "cpu")
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < bucket.nbytes:
        raise ValueError(f"out must be a 1-d uint8 tensor of at least {bucket.nbytes} bytes")
    out = out[: bucket.nbytes]
    for entry in bucket.entries:
        pack_one(out, entry, tensors[entry.hf_name])
    return out


def unpack(
    buffer: torch.Tensor,
    bucket: BucketMeta,
    *,
    copy: bool = False,
) -> list[tuple[str, torch.Tensor]]:
    """Split a packed buffer back into `(hf_name, tensor)` pairs, in bucket order.

    A sparse entry comes back as its uint8 payload.
    With `copy=False` the tensors are VIEWS of `buffer`: clone them (or pass
    `copy=True`) before the buffer is reused or freed.
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"a packed bucket is a 1-d uint8 tensor, got {buffer.dim()}-d {buffer.dtype}")
    if buffer.numel() != bucket.nbytes:
        raise ValueError(f"bucket {bucket.index}: buffer has {buffer.numel()} bytes, expected {bucket.nbytes}")
    out = []
    for entry in bucket.entries:
        t = entry_view(buffer, entry) if entry.is_dense else payload_view(buffer, entry)
        out.append((entry.hf_name, t.clone() if copy else t))
    return out


def bucket_views(buffer: torch.Tensor, bucket: BucketMeta) -> list[torch.Tensor]:
    """Every entry of `bucket` as a view of its packed `buffer` (1-d uint8 of exactly
    `bucket.nbytes`, entries back to back as `layout_bucket` places them), in bucket
    order: what `entry_view` gives for a dense entry, `payload_view` for a sparse one.

    One `as_strided` per entry on a typed view of each run of one dtype (half the calls
    of a slice and two views), from a plan of the runs made once per bucket layout
    (`BucketMeta.memo`, shared push after push while the plan stays), so that staging
    tens of thousands of small tensors costs about a microsecond each. The views alias
    the buffer."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != bucket.nbytes:
        raise ValueError(f"bucket {bucket.index}: expected a 1-d uint8 buffer of {bucket.nbytes} bytes, got "
                         f"{tuple(buffer.shape)} {buffer.dtype}")
    runs = bucket.memo.get("view_runs")
    if runs is None:
        runs = bucket.memo["view_runs"] = _view_runs(bucket)
    views: list[torch.Tensor] = []
    for dtype, start, end, places in runs:
        typed = buffer[start:end].view(dtype)
        base = typed.storage_offset()
        views += [typed.as_strided(shape, strides, base + offset) for shape, strides, offset in places]
    return views


_Place = tuple[tuple[int, ...], tuple[int, ...], int]
"""An entry's view of a typed run: its shape, its contiguous strides, its offset in the run's elements."""


def _view_runs(bucket: BucketMeta) -> list[tuple[torch.dtype, int, int, list[_Place]]]:
    """The runs of one stored dtype in `bucket` (dtype, first byte, end byte of the typed
    view, and each entry's place in it), checking that the entries lie back to back."""
    runs: list[tuple[torch.dtype, int, int, list[_Place]]] = []
    places: list[_Place] = []
    dtype, itemsize, start = None, 1, 0
    offset = 0
    for entry in bucket.entries:
        if entry.offset != offset:
            raise ValueError(f"bucket {bucket.index}: {entry.hf_name!r} at offset {entry.offset}, expected "
                             f"{offset} (entries lie back to back)")
        offset += entry.nbytes
        if offset > bucket.nbytes:  # never, for a bucket's own entries: they sum to its size
            raise ValueError(f"bucket {bucket.index}: {entry.hf_name!r} reaches past its {bucket.nbytes} bytes")
        if entry.stored_dtype != dtype:  # a run of another dtype starts: view the rest of the bucket as it
            dtype = entry.stored_dtype
            itemsize = dtype.itemsize
            start = entry.offset
            places = []
            runs.append((dtype, start, start + (bucket.nbytes - start) // itemsize * itemsize, places))
        shape = entry.stored_shape
        places.append((shape, _contiguous_strides(shape), (entry.offset - start) // itemsize))
    return runs


_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (in elements), computed once per shape."""
    strides = _STRIDES.get(shape)
    if strides is None:
        out, step = [], 1
        for size in reversed(shape):
            out.append(step)
            step *= max(size, 1)
        strides = tuple(reversed(out))
        if len(_STRIDES) < 4096:
            _STRIDES[shape] = strides
    return strides


def stream_order(plan: Sequence[BucketMeta]) -> list[str]:
    """The order a source must yield tensors in for `pack_stream`: bucket by
    bucket, each bucket in buffer order. Identical on every rank."""
    return [e.hf_name for b in plan for e in b.entries]


def pack_stream(
    plan: Iterable[BucketMeta],
    tensors: Iterable[tuple[str, torch.Tensor | TensorParts]],
    *,
    keep: bool = True,
    alloc: Callable[[BucketMeta], torch.Tensor | None] = allocate,
    allow_overflow: bool = False,
) -> Iterator[tuple[BucketMeta, torch.Tensor | None]]:
    """Pack a tensor stream bucket by bucket, holding one bucket at a time.

    `tensors` must yield in `stream_order(plan)`; each tensor (or its run of small tensors, one
    `_chunk_cat`) is copied into its bucket, cast to its entry's dtype exactly as `pack_one` casts, and
    dropped: peak memory is one bucket plus the tensors in hand (see `_Run`). `alloc` gives each bucket
    its buffer (default: a fresh CPU tensor); when it returns None the bucket's tensors are consumed but
    not packed (a failed sender keeps draining a sharded source so the other ranks' gathers complete).
    With `keep=False` (a rank that only takes part in gathers) nothing is packed and None is yielded.
    """
    it = iter(tensors)
    for bucket in plan:
        buffer = alloc(bucket) if keep else None
        run = None
        if buffer is not None:
            buffer = buffer[: bucket.nbytes]
            run = _Run(buffer, allow_overflow=allow_overflow)
        try:
            _pack_bucket(bucket, it, run)
        except BaseException:
            if run is not None:
                run.abandon()  # no copy writes into the buffer once the caller has it back
            raise
        yield bucket, buffer
        buffer = run = None  # the consumer decides how long the bucket lives


def _pack_bucket(bucket: BucketMeta, it: Iterator[tuple[str, torch.Tensor | TensorParts]], run: _Run | None) -> None:
    """`bucket`'s tensors read from `it` and packed by `run` (read only, without one), every copy done."""
    entries = bucket.entries
    runs = bucket.memo.get("pack_runs")
    if runs is None:
        runs = bucket.memo["pack_runs"] = _pack_runs(entries)
    i = 0  # the next entry to read
    for start, stop, names, shapes in runs:
        for entry in entries[i:start]:  # what no run holds: one by one
            _take(it, entry, run)
        i = start
        if run is None:
            continue  # read one by one
        held: list[torch.Tensor] = []
        for name in names:
            try:
                hf_name, tensor = next(it)
            except StopIteration:
                raise ValueError(f"tensor stream ended before {name!r}") from None
            if hf_name != name:
                raise ValueError(f"tensor stream out of order: got {hf_name!r}, the plan expects {name!r}")
            i += 1
            if isinstance(tensor, TensorParts):  # its parts are read now, before the next tensor
                for entry, earlier in zip(entries[start : i - 1], held, strict=True):
                    run.add(entry, earlier)
                _add_parts(run, entries[i - 1], tensor)
                break
            held.append(tensor)
        else:
            run.add_all(entries[start:stop], held, shapes)
        del held, tensor  # a gathered tensor (FSDP2) lives no longer than its copy
    for entry in entries[i:]:
        _take(it, entry, run)
    if run is not None:
        run.finish()


def _take(it: Iterator[tuple[str, torch.Tensor | TensorParts]], entry: TensorEntry, run: _Run | None) -> None:
    """The stream's next tensor, which must be `entry`'s, added to `run` (read only, without one)."""
    try:
        name, tensor = next(it)
    except StopIteration:
        raise ValueError(f"tensor stream ended before {entry.hf_name!r}") from None
    if name != entry.hf_name:
        raise ValueError(f"tensor stream out of order: got {name!r}, the plan expects {entry.hf_name!r}")
    if isinstance(tensor, TensorParts):
        _add_parts(run, entry, tensor)
    elif run is not None:
        run.add(entry, tensor)


_PackRun = tuple[int, int, tuple[str, ...], list[tuple[int, ...]]]
"""A run of a bucket's entries packed with one call when their tensors allow: first and
end index, the entries' names and shapes."""


def _pack_runs(entries: Sequence[TensorEntry]) -> list[_PackRun]:
    """The runs `_Run.add` makes of `entries` as far as the entries alone tell (dense,
    non-empty, under LARGE_BYTES, at least one dimension, back to back, one dtype, at most
    RUN_MAX_TENSORS tensors and RUN_MAX_BYTES), of two entries or more: made once per bucket layout
    (`BucketMeta.memo`), so that a push checks each run's tensors together (`_Run.add_all`)."""
    runs: list[_PackRun] = []
    start: int | None = None
    dtype, nbytes, end = None, 0, 0

    def close(stop: int) -> None:
        if start is not None and stop - start > 1:
            run = entries[start:stop]
            runs.append((start, stop, tuple(e.hf_name for e in run), [e.shape for e in run]))

    for i, entry in enumerate(entries):
        size = entry.nbytes
        fits = 0 < size < LARGE_BYTES and entry.encoding == "dense" and len(entry.shape) > 0
        if (fits and start is not None and entry.dtype is dtype and entry.offset == end
                and i - start < RUN_MAX_TENSORS and nbytes + size <= RUN_MAX_BYTES):
            nbytes += size
            end += size
            continue
        close(i)
        start, dtype, nbytes, end = (i, entry.dtype, size, entry.offset + size) if fits else (None, None, 0, 0)
    close(len(entries))
    return runs


class _Run:
    """Consecutive entries of one bucket whose tensors are packed with one call
    (`torch._chunk_cat`, which flattens each tensor in C++ and casts into the bucket's view
    exactly as `.to()` does): dense, contiguous, non-empty tensors of at least one
    dimension on the buffer's device, all of one dtype cast to one entry dtype. Anything
    else is packed on its own by `pack_one` (after the run so far).

    Where the buffer is in host memory and torch has more than one intra-op thread, each
    copy (a run, or a tensor on its own) goes to the helper thread when it is free and is
    done here when it is busy, each on one intra-op thread: the two threads copy while
    this one also reads the stream, without a thread handing work to a busy one. The
    helper holds what it copies until it is done (one run, or one tensor, beyond the
    tensors in hand); `finish` waits for it, so a bucket is complete when it is yielded."""

    def __init__(self, buffer: torch.Tensor, *, allow_overflow: bool) -> None:
        self.buffer = buffer
        self.device = buffer.device
        self.allow_overflow = allow_overflow
        self.entries: list[TensorEntry] = []
        self.tensors: list[torch.Tensor] = []
        self.nbytes = 0
        self.end = 0
        """The offset just past the run's last entry."""
        self.src: torch.dtype | None = None
        self.dst: torch.dtype | None = None
        self.two_threads = buffer.device.type == "cpu" and torch.get_num_threads() > 1
        self.pending: Future[None] | None = None
        """The copy on the helper thread, if one was given to it."""

    def add(self, entry: TensorEntry, tensor: torch.Tensor) -> None:
        nbytes = entry.nbytes
        if (not 0 < nbytes < LARGE_BYTES or entry.encoding != "dense" or not tensor.dim()
                or not tensor.is_contiguous() or tensor.device != self.device):
            self.flush()
            job = partial(pack_one, self.buffer, entry, tensor, allow_overflow=self.allow_overflow)
            if nbytes < LARGE_BYTES and tensor.device == self.device:
                self._copy(job)
            else:  # a large tensor is copied here on all of torch's threads once the helper is done
                self.wait()
                job()
            return
        src, dst = tensor.dtype, entry.dtype
        if (src is not self.src or dst is not self.dst or len(self.tensors) >= RUN_MAX_TENSORS
                or self.nbytes + nbytes > RUN_MAX_BYTES or entry.offset != self.end):
            self.flush()
            if not castable(src, dst):
                _check_fits(entry, tensor)  # raises, naming the tensor
            self.src, self.dst = src, dst
        if tensor.shape != entry.shape:
            _check_fits(entry, tensor)
        self.entries.append(entry)
        self.tensors.append(tensor)
        self.nbytes += nbytes
        self.end = entry.offset + nbytes

    def add_all(self, entries: Sequence[TensorEntry], tensors: list[torch.Tensor],
                shapes: list[tuple[int, ...]]) -> None:
        """`add` each of `entries` (a run of `_pack_runs`, `shapes` their shapes) with its
        tensor. Where the tensors are what such a run takes (one castable dtype, contiguous,
        on the buffer's device, of the entries' shapes), checked with one pass of C calls
        over all of them, they are copied with one call; else they go one by one through
        `add`, which packs the same bytes and raises the same errors."""
        dtypes = set(map(_DTYPE, tensors))
        src, dst = tensors[0].dtype, entries[0].dtype
        if (len(dtypes) != 1 or not castable(src, dst) or not all(map(torch.Tensor.is_contiguous, tensors))
                or set(map(_DEVICE, tensors)) != {self.device} or list(map(_SHAPE, tensors)) != shapes):
            for entry, tensor in zip(entries, tensors, strict=True):
                self.add(entry, tensor)
            return
        self.flush()
        self.entries, self.tensors, self.src, self.dst = list(entries), tensors, src, dst
        self.nbytes = entries[-1].offset + entries[-1].nbytes - entries[0].offset
        self.end = entries[0].offset + self.nbytes
        self.flush()

    def flush(self) -> None:
        """The run so far copied (or given to the helper), and a new one begun."""
        entries, tensors = self.entries, self.tensors
        self.entries, self.tensors, self.nbytes, self.src, self.dst = [], [], 0, None, None
        if len(entries) == 1:
            self._copy(partial(pack_one, self.buffer, entries[0], tensors[0], allow_overflow=self.allow_overflow))
        elif entries:
            self._copy(partial(_copy_run, self.buffer, entries, tensors, allow_overflow=self.allow_overflow))

    def finish(self) -> None:
        """Every copy done, the helper's included."""
        self.flush()
        self.wait()

    def wait(self) -> None:
        """The helper's copy, if any, done (its error, naming its tensor, raised here)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def abandon(self) -> None:
        """Wait for the helper's copy, if any, ignoring its error (another one is on its way)."""
        with contextlib.suppress(BaseException):
            self.wait()

    def _copy(self, job: Callable[[], None]) -> None:
        """`job` done on the helper thread if it is free, else here, on one intra-op thread
        whenever the helper may be copying too."""
        if not self.two_threads:
            job()
            return
        pending = self.pending
        if pending is not None and not pending.done():
            _on_one_thread(job)
            return
        self.wait()
        self.pending = _helper().submit(_on_one_thread, job)


def _copy_run(buffer: torch.Tensor, entries: list[TensorEntry], tensors: list[torch.Tensor], *,
              allow_overflow: bool) -> None:
    """A run's tensors flattened into its bytes with one call, cast as .to() casts, then
    checked for values a narrower dtype could not hold: one reduction for the run, per
    tensor only to name one."""
    first, last, dtype = entries[0], entries[-1], entries[0].dtype
    out = buffer[first.offset : last.offset + last.nbytes].view(dtype)
    with torch.no_grad():
        torch._chunk_cat(tensors, 0, 1, out=out.view(1, -1))
    if tensors[0].dtype != dtype and not allow_overflow and torch.finfo(dtype).max < torch.finfo(tensors[0].dtype).max:
        low, high = torch.aminmax(out)
        if not (torch.isfinite(low) and torch.isfinite(high)):
            for entry, tensor in zip(entries, tensors, strict=True):
                check_cast(entry.hf_name, tensor, entry_view(buffer, entry))


_HELPERS: dict[int, ThreadPoolExecutor] = {}
"""The helper thread's pool, by the process that made it: a child forked after a push has the
parent's pool without its thread, where a job would wait forever."""


def _helper() -> ThreadPoolExecutor:
    pid = os.getpid()
    pool = _HELPERS.get(pid)
    if pool is None:
        _HELPERS.clear()
        pool = _HELPERS[pid] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-run")
    return pool


def _on_one_thread(job: Callable[[], None]) -> None:
    """`job` with this thread's torch ops on one intra-op thread: with more, `torch.cat`
    (which `_chunk_cat` is on the CPU) leaves its serial kernel, one memcpy per tensor, for
    a TensorIterator copy per tensor, slower on the same bytes, and two copies at once would
    ask for more threads than there are cores. torch's thread count is per thread under
    OpenMP (each thread's own `omp_set_num_threads`), and this thread's is restored on the
    way out. Under no_grad: the helper thread's grad mode is its own."""
    before = torch.get_num_threads()
    with torch.no_grad():  # a copy records nothing, whichever thread does it and whatever it is given
        if before == 1:
            job()
            return
        torch.set_num_threads(1)
        try:
            job()
        finally:
            torch.set_num_threads(before)


_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_SHAPE = operator.attrgetter("shape")


class TensorParts:
    """One tensor of a stream given as the tensors that lie back to back in it, in memory
    order, each under a name of its own (the one errors name): a fused expert tensor
    `[E, 2I, H]` as its experts' gate and up matrices (e0 gate, e0 up, e1 gate, ...), part i
    at element offset i x `part_shape`'s size. `pack_stream` casts each into its place in the
    bucket. Iterated once, as the parts are read (an FSDP2 source gathers each as it comes):
    iterate it before asking the stream for its next tensor."""

    __slots__ = ("_left", "_parts", "num_parts", "part_shape", "shape")

    def __init__(self, parts: Iterable[tuple[str, torch.Tensor]], *, shape: tuple[int, ...],
                 part_shape: tuple[int, ...]) -> None:
        self._parts = iter(parts)
        self.shape = shape
        """The whole tensor's shape."""
        self.part_shape = part_shape
        """Every part's shape; the parts' sizes sum to the whole's."""
        whole, one = math.prod(shape), math.prod(part_shape)
        if one == 0 or whole % one:
            raise ValueError(f"a tensor of shape {shape} is not made of parts of shape {part_shape}")
        self.num_parts = whole // one
        self._left = self.num_parts

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of each part not read yet: `num_parts` of them in all, or ValueError."""
        while self._left:
            item = next(self._parts, None)
            if item is None:
                raise ValueError(f"the parts of a {self.shape} tensor ended after "
                                 f"{self.num_parts - self._left} of {self.num_parts}")
            self._left -= 1
            yield item

    def assemble(self) -> torch.Tensor:
        """The whole tensor, a new one holding the parts (of the first part's dtype and device):
        for a caller that wants it whole; packing never makes it."""
        if self._left != self.num_parts:
            raise ValueError("assemble() reads every part: this TensorParts was read already")
        whole: torch.Tensor | None = None
        for i, (_, part) in enumerate(self):
            if whole is None:
                whole = torch.empty(self.shape, dtype=part.dtype, device=part.device)
            whole.view(self.num_parts, *self.part_shape)[i].copy_(part)
        assert whole is not None
        return whole

    def drain(self) -> None:
        """Read whatever parts are left (a rank that packs nothing still takes part in their gathers)."""
        for _ in self:
            pass


def _add_parts(run: _Run | None, entry: TensorEntry, parts: TensorParts) -> None:
    """Each part of `parts` cast and packed into its byte range of dense `entry` (read, not packed,
    without a run)."""
    if not entry.is_dense or parts.shape != entry.shape:
        raise ValueError(f"tensor {entry.hf_name!r} comes in parts, {parts.shape}; the plan says {entry.shape} "
                         f"{entry.encoding}: re-plan after changing the model")
    offset, step = entry.offset, math.prod(parts.part_shape) * entry.dtype.itemsize
    for hf_name, tensor in parts:
        if run is not None:
            run.add(TensorEntry(hf_name=hf_name, dtype=entry.dtype, shape=parts.part_shape, offset=offset), tensor)
        offset += step


def _check_fits(entry: TensorEntry, tensor: torch.Tensor) -> None:
    """`tensor` may be packed as `entry`: its shape, and a dtype that may travel as the entry's."""
    if tensor.shape != entry.shape or not castable(tensor.dtype, entry.dtype):
        raise ValueError(
            f"tensor {entry.hf_name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
            f"the plan says {entry.shape} {entry.dtype}; re-plan after changing the model"
        )
