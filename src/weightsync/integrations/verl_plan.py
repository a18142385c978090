"""Bucket plan of a tensor stream known only as it is read: verl's `send_weights(weights)` generator.

`StreamPlan` plans one bucket at a time with weightsync's rule (`bucketing.layout_bucket`), just
before the pipeline packs it, and is the `WeightSource` that `push.pipeline.stream_buckets` reads
(`buckets()` the plan, `tensors()` the stream in plan order). Packing, the cast and the digests
stay the pipeline's. A bucket's source tensors are held until packed (2x the bucket's bytes for
float32 sent as bfloat16). Called by `integrations.verl_update`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

import torch

from weightsync.bucketing import layout_bucket
from weightsync.manifest import BucketMeta, TensorMeta


class StreamPlan:
    """Buckets of `weights` planned as it is read, for one push through the pipeline.

    `dtype`: floating tensors travel as this dtype (the engine's), cast by the packer;
    None sends them as yielded, and so are those whose name ends with one of `keep_dtype`
    (routers the engine keeps in float32). `max_tensor_bytes`: refuse a tensor that would not fit
    a bucket slot of that size (shm's slots are sized before the first tensor is read).
    Every trainer rank must yield the same names in the same order (verl's FSDP
    generator gathers on every rank); only the sending rank reads it through a plan.
    """

    mode = "full"

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int,
                 dtype: torch.dtype | None, max_tensor_bytes: int | None = None,
                 keep_dtype: Sequence[str] = ()) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.keep_dtype = tuple(keep_dtype)
        self.max_tensor_bytes = max_tensor_bytes
        self.planned: list[BucketMeta] = []
        """The buckets laid out so far, in order (the whole plan once `buckets()` ended)."""
        self._it = iter(weights)
        self._next: tuple[str, torch.Tensor, TensorMeta] | None = None
        """The tensor read but not yet placed (the first of the next bucket), with its meta."""
        self._held: dict[str, torch.Tensor] = {}
        self._seen: set[str] = set()
        self.read_s = 0.0
        """Seconds spent reading the stream (verl's gathers), which the pipeline counts as packing."""

    def buckets(self) -> Iterator[BucketMeta]:
        """The plan: bucket k is laid out once its tensors (and the first of bucket k+1) are read."""
        while True:
            metas: list[TensorMeta] = []
            nbytes = 0
            while True:
                if self._next is None:
                    started = time.perf_counter()
                    item = next(self._it, None)
                    self.read_s += time.perf_counter() - started
                    if item is None:
                        break
                    self._next = (item[0], item[1], self._meta(*item))
                name, tensor, meta = self._next
                if metas and nbytes + meta.nbytes > self.bucket_bytes:
                    break
                metas.append(meta)
                nbytes += meta.nbytes
                self._held[name] = tensor
                self._next = None
            if not metas:
                return
            bucket = layout_bucket(len(self.planned), metas)
            self.planned.append(bucket)
            yield bucket

    def metas(self) -> Sequence[TensorMeta]:
        """The tensors planned so far (the stream is not known before it is read)."""
        return [e.meta for b in self.planned for e in b.entries]

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream in plan order (bucket by bucket, each in buffer order); `buckets()`
        must have laid out a bucket before its tensors are asked for, as `pack_stream` does."""
        if hf_names:
            raise ValueError("a StreamPlan yields its stream in its own order; ask with no names")
        index = 0
        while index < len(self.planned):
            for entry in self.planned[index].entries:
                yield entry.hf_name, self._held.pop(entry.hf_name)
            index += 1

    def drain(self) -> None:
        """Read the rest of the stream, keeping nothing: after a failure, so that the
        other trainer ranks' gathers (collectives over the actor group) complete."""
        self._held.clear()
        self._next = None
        for _ in self._it:
            pass

    def _meta(self, name: str, tensor: torch.Tensor) -> TensorMeta:
        if name in self._seen:
            raise ValueError(f"tensor {name!r} is yielded twice; each name must be sent once")
        self._seen.add(name)
        cast = self.dtype is not None and tensor.is_floating_point() and not name.endswith(self.keep_dtype)
        dtype = self.dtype if cast and self.dtype is not None else tensor.dtype
        meta = TensorMeta(hf_name=name, dtype=dtype, shape=tuple(tensor.shape))
        if self.max_tensor_bytes is not None and meta.nbytes > self.max_tensor_bytes:
            raise ValueError(f"tensor {name!r} is {meta.nbytes} bytes as {dtype}, over the "
                             f"{self.max_tensor_bytes}-byte shm slot; raise checkpoint_engine."
                             f"update_weights_bucket_megabytes to at least {-(-meta.nbytes // (1 << 20))}, "
                             "or use transport='broadcast'")
        return meta
