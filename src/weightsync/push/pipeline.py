"""The streaming pipeline of one push: a producer thread gathers, casts, packs and
hashes bucket k+1 while the caller delivers bucket k.

Buckets are packed into the transport's slots (`slot(k, nbytes)` for bucket k:
slot k % NUM_SLOTS, or a leased slot of its own); a bucket is packed only once
the bucket NUM_SLOTS before it was delivered, so at most NUM_SLOTS buckets are
alive and trainer memory stays within NUM_SLOTS x bucket_bytes beyond the model.
Time spent per stage goes into `Stages`. On a failure the producer stops at the next slot it waits for; with
`drain` (other trainer ranks gather along) it keeps gathering without packing,
so every rank finishes the same collectives.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from weightsync.digests import XXH3_64, digest
from weightsync.manifest import BucketMeta
from weightsync.push.packer import pack_stream
from weightsync.reports import Stages
from weightsync.sources import WeightSource
from weightsync.transports.base import NUM_SLOTS

T = TypeVar("T")


class Handoff(Generic[T]):
    """Items made on a producer thread of their own, taken one at a time by the caller:

        with Handoff(produce, name=...) as items:
            for item in items: ...

    The thread runs `produce(put, stop)`; `put` waits while the caller has not taken the
    last item, so at most one item waits. An exception in `produce` is raised to the
    caller when it reaches it. When the caller leaves early (its own exception), `stop`
    is set, and what the producer still puts is taken and dropped until it returns: a
    producer waiting for something (a free slot) must watch `stop`."""

    def __init__(self, produce: Callable[[Callable[[T], None], threading.Event], None], *, name: str) -> None:
        self._produce = produce
        self._ready: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Handoff[T]:
        self._thread.start()
        return self

    def __iter__(self) -> Iterator[T]:
        while (item := self._ready.get()) is not _DONE:
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        while self._thread.is_alive():  # unblock a producer waiting to hand over an item
            with contextlib.suppress(queue.Empty):
                self._ready.get(timeout=0.1)
        self._thread.join()

    def _run(self) -> None:
        try:
            self._produce(self._ready.put, self.stop)
            self._ready.put(_DONE)
        except BaseException as e:
            self._ready.put(_Failed(e))


_DONE = object()


@dataclass(frozen=True)
class _Failed:
    error: BaseException


def stream_buckets(source: WeightSource, plan: Iterable[BucketMeta], order: Sequence[str],
                   to_engine: Mapping[str, str] | None, *, slot: Callable[[int, int], torch.Tensor],
                   deliver: Callable[[BucketMeta, torch.Tensor], None], stages: Stages,
                   allow_overflow: bool = False, drain: bool = False,
                   digest_algorithm: str = XXH3_64, first: Callable[[], None] | None = None,
                   pack_threads: int | None = None) -> list[str]:
    """Pack (gather, cast, hash) on a producer thread while this thread calls `deliver(bucket, buffer)`
    for each bucket in plan order; returns the buckets' digests (`digest_algorithm`, computed on the
    slot's device: wsmix64 hashes a CUDA slot in place).

    `order`: the source's (hf) names in stream order; the plan holds engine names (`to_engine` maps
    them; None: the same names). The plan is iterated once, each bucket before its tensors are asked
    for, so it may be laid out as the stream is read. `slot(index, nbytes)`: the buffer bucket `index`
    is packed into. `first`: called here once the producer has started, before the first `deliver` (the
    engines' begin, overlapping the first packing); if it raises, nothing is delivered. `pack_threads`:
    torch's intra-op threads on the producer (None: torch's count); the caller's own stays as it is.
    """
    free_slots = threading.Semaphore(NUM_SLOTS)
    waited = 0.0

    def produce(put: Callable[[tuple[BucketMeta, torch.Tensor]], None], stop: threading.Event) -> None:
        threads = torch.get_num_threads()
        with torch.no_grad():  # what is read is only copied: a module source then yields no detached aliases
            if pack_threads is None or pack_threads == threads:
                pack(put, stop)
                return
            torch.set_num_threads(pack_threads)
            try:
                pack(put, stop)
            finally:
                torch.set_num_threads(threads)

    def pack(put: Callable[[tuple[BucketMeta, torch.Tensor]], None], stop: threading.Event) -> None:
        def alloc(bucket: BucketMeta) -> torch.Tensor | None:
            nonlocal waited
            t0 = time.perf_counter()
            try:
                while not stop.is_set():
                    if free_slots.acquire(timeout=0.1):
                        return slot(bucket.index, bucket.nbytes)
                return None
            finally:
                waited += time.perf_counter() - t0

        gather = _Timed(source.tensors(order))
        tensors: Iterator[tuple[str, Any]] = gather
        if to_engine is not None:
            tensors = ((to_engine[n], t) for n, t in tensors)
        t_prev = time.perf_counter()
        try:
            for bucket, buffer in pack_stream(plan, tensors, alloc=alloc, allow_overflow=allow_overflow):
                if buffer is None:
                    if not drain:
                        break
                    continue
                t_hash = time.perf_counter()
                bucket = bucket.with_digest(digest(buffer, digest_algorithm))
                now = time.perf_counter()
                stages.hash += now - t_hash
                stages.pack += t_hash - t_prev
                put((bucket, buffer))
                t_prev = time.perf_counter()
        finally:
            stages.gather += gather.seconds

    digests: list[str] = []
    with Handoff(produce, name="weightsync-pack") as packed:
        if first is not None:
            first()
        for bucket, buffer in packed:
            t0 = time.perf_counter()
            deliver(bucket, buffer)
            stages.wire += time.perf_counter() - t0
            free_slots.release()
            assert bucket.digest is not None
            digests.append(bucket.digest)
    stages.pack = max(0.0, stages.pack - stages.gather - waited)
    return digests


def threads_beside_engines() -> int:
    """Intra-op threads for packing while engines on this host receive (shm): torch's
    count less the core the engine's own receive thread needs, at least one. On a small
    host this matters more than the copy's speed: with every core packing, each parallel
    copy waits at its barrier for a thread the engine's work descheduled, and OpenMP's
    waiting threads spin on the cores the engine needs."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), cores - 1))


class _Timed(Iterator[T]):
    """`it`, with the time spent inside its `next` summed in `seconds`."""

    def __init__(self, it: Iterator[T]) -> None:
        self._next = it.__next__
        self.seconds = 0.0

    def __iter__(self) -> _Timed[T]:
        return self

    def __next__(self) -> T:
        t0 = _clock()
        try:
            return self._next()
        finally:
            self.seconds += _clock() - t0


_clock = time.perf_counter
