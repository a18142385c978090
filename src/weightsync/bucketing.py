"""Plan, pack and unpack flat buckets. Pure: tensors in, tensors out, no I/O.

A bucket is one contiguous uint8 buffer, its tensors back to back by descending itemsize, no
padding: SGLang's "flattened_bucket" layout byte for byte. The plan is greedy in the source's order
(every rank planning the same metas gets the same plan); a tensor larger than `bucket_bytes` gets a
bucket of its own. Transports and engines move and read the buffers; the pipeline
(`push.pipeline`) and the receiving side call this module. How a stream is packed cheaply per
tensor: docs/PERFORMANCE.md ("Per-tensor cost").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from weightsync.dtypes import castable
from weightsync.errors import CastError
from weightsync.manifest import BucketMeta, TensorEntry, TensorMeta


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
    check_fits(entry, tensor)
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


def check_fits(entry: TensorEntry, tensor: torch.Tensor) -> None:
    """`tensor` may be packed as `entry`: its shape, and a dtype that may travel as the entry's."""
    if tensor.shape != entry.shape or not castable(tensor.dtype, entry.dtype):
        raise ValueError(
            f"tensor {entry.hf_name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
            f"the plan says {entry.shape} {entry.dtype}; re-plan after changing the model"
        )
