"""The streaming packer: a trainer's tensor stream packed bucket by bucket, holding one bucket
at a time, small tensors copied in runs on a helper thread. The plan, the layout and
`pack`/`unpack` are `weightsync.bucketing`'s; how a stream is packed cheaply per tensor:
docs/PERFORMANCE.md ("Per-tensor cost").
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import torch

from weightsync.bucketing import TensorParts, allocate, check_cast, check_fits, entry_view, pack_one
from weightsync.dtypes import castable
from weightsync.manifest import BucketMeta, TensorEntry

RUN_MAX_TENSORS = 256
"""Tensors `pack_stream` copies with one call at most (a run)."""
RUN_MAX_BYTES = 16 << 20
"""Bytes of the tensors a run holds at most before they are copied: a source that
materialises tensors (an FSDP2 gather, a LoRA merge) holds up to twice this much
beyond the tensor in hand (the run it reads, and the one the helper thread copies)."""
LARGE_BYTES = 4 << 20
"""A tensor at least this large is copied on its own, on all of torch's threads."""


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
                check_fits(entry, tensor)  # raises, naming the tensor
            self.src, self.dst = src, dst
        if tensor.shape != entry.shape:
            check_fits(entry, tensor)
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
