"""How one tensor's bytes sit in its bucket: whole (`dense`), or only its changed elements.

Names the encodings (`ENCODINGS`) and their sizes (`encoded_nbytes`), encodes the changed elements
between two versions compared bitwise in the engine's dtype (`encode`, the smallest encoding wins),
and applies a payload (`apply_payload`). Pure: tensors in, tensors out, no I/O. Called by
`mode="sparse"` on the trainer, by the manifest to check entry sizes, and by every engine that
applies sparse updates. The payload layouts: docs/PROTOCOL.md ("Sparse").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from weightsync.errors import IntegrityError, ManifestError

ENCODINGS: tuple[str, ...] = ("dense", "positions16", "positions32", "bitmap")
"""How one tensor's bytes sit in its bucket (the layouts: this module's docstring):
"dense" is the tensor itself; the others, in "sparse" manifests only, carry the
elements that changed since the base version."""
PAYLOAD_ALIGN = 8
"""Sparse payloads are zero-padded to a multiple of this many bytes, so the entries
after them stay aligned to their itemsize."""


def encoded_nbytes(encoding: str, numel: int, itemsize: int, num_changed: int) -> int:
    """Bytes one tensor of `numel` elements takes in its bucket under `encoding`
    (`num_changed`: the elements a sparse encoding carries)."""
    if encoding == "dense":
        return numel * itemsize
    if encoding == "positions16":
        raw = num_changed * (itemsize + 2)
    elif encoding == "positions32":
        raw = num_changed * (itemsize + 4)
    elif encoding == "bitmap":
        raw = num_changed * itemsize + (numel + 7) // 8
    else:
        raise ManifestError(f"unknown encoding {encoding!r}; one of {ENCODINGS}")
    return raw + (-raw % PAYLOAD_ALIGN)


INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype elements of each width are compared (and carried) as."""
_GAP_DTYPES = {"positions16": torch.uint16, "positions32": torch.uint32}
_MAX_GAP16 = (1 << 16) - 1


@dataclass(frozen=True)
class Encoded:
    """One tensor's change, encoded."""

    encoding: str
    """"dense", "positions16", "positions32" or "bitmap"."""
    num_changed: int
    """Elements whose bytes differ from the base."""
    payload: torch.Tensor | None
    """The uint8 payload of a sparse encoding (None for "dense": send the tensor)."""


def bits_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat integer view of `tensor`'s bytes (one integer per element), for bitwise
    comparison. `tensor` must be contiguous."""
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(INT_OF_SIZE[flat.dtype.itemsize])


def changed(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of the elements of `new` whose bytes differ from `base`'s."""
    _check_alike(new, base)
    return bits_view(new.contiguous()) != bits_view(base.contiguous())


def _check_alike(new: torch.Tensor, base: torch.Tensor) -> None:
    if new.dtype != base.dtype or new.shape != base.shape or new.device != base.device:
        raise ValueError(f"cannot compare {tuple(new.shape)} {new.dtype} on {new.device} with "
                         f"{tuple(base.shape)} {base.dtype} on {base.device}")


class Changes:
    """The changed elements of one tensor: on the CPU through numpy (its boolean indexing,
    flatnonzero and count are several times torch's on CPU), elsewhere through torch."""

    def __init__(self, new: torch.Tensor, base: torch.Tensor) -> None:
        _check_alike(new, base)
        self._new = bits_view(new.contiguous())
        self._cpu = new.device.type == "cpu"
        self._np_positions: np.ndarray[Any, Any] | None = None
        if self._cpu:
            self._np_new = self._new.numpy()
            self._np_mask = self._np_new != bits_view(base.contiguous()).numpy()
            self.count = int(np.count_nonzero(self._np_mask))
        else:
            self._mask = self._new != bits_view(base.contiguous())
            self.count = int(torch.count_nonzero(self._mask))

    def values(self) -> torch.Tensor:
        """The new elements (as integers of their width) at the changed positions, ascending."""
        if self._cpu:  # gathering at the positions costs per change; a boolean index per element
            return torch.from_numpy(np.take(self._np_new, self._positions()))
        return self._new[self._mask]

    def _positions(self) -> np.ndarray[Any, Any]:
        if self._np_positions is None:
            self._np_positions = np.flatnonzero(self._np_mask)
        return self._np_positions

    def positions(self) -> np.ndarray[Any, Any]:
        """The changed flat positions, ascending (int64, on the host)."""
        if self._cpu:
            return self._positions().astype(np.int64, copy=False)
        return self._mask.nonzero().squeeze(1).cpu().numpy()

    def bits(self) -> torch.Tensor:
        """The mask as bytes, bit i % 8 of byte i // 8 (little bit order; `apply_payload`
        reads them back with numpy's unpackbits)."""
        if self._cpu:
            return torch.from_numpy(np.packbits(self._np_mask, bitorder="little"))
        padded = torch.nn.functional.pad(self._mask.to(torch.uint8), (0, -self._mask.numel() % 8)).view(-1, 8)
        weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=self._mask.device)
        return (padded * weights).sum(dim=1, dtype=torch.uint8)

    def gaps(self) -> torch.Tensor:
        """The delta-coded changed positions (int64): p[0], p[i] - p[i-1]."""
        if self._cpu:
            return torch.from_numpy(np.diff(self._positions(), prepend=0))
        positions = self._mask.nonzero().squeeze(1)
        return torch.diff(positions, prepend=positions.new_zeros(1))


def encode(new: torch.Tensor, base: torch.Tensor) -> Encoded:
    """The cheapest encoding of `new` on top of `base` (same dtype, shape and device)."""
    changes = Changes(new, base)
    return _encode(new.numel(), new.dtype.itemsize, changes.count, changes.values, changes.gaps, changes.bits)


def encode_positions(numel: int, itemsize: int, positions: np.ndarray[Any, Any], values: torch.Tensor) -> Encoded:
    """The cheapest encoding of the changes at flat `positions` (ascending int64) whose
    new elements are `values` (integers of the tensor's width), in a tensor of `numel`:
    what `encode` gives for the same change (sharded trainers gather changes, not tensors)."""
    def gaps() -> torch.Tensor:
        return torch.from_numpy(np.diff(positions, prepend=0))

    def bits() -> torch.Tensor:
        mask = np.zeros(numel, dtype=np.bool_)
        mask[positions] = True
        return torch.from_numpy(np.packbits(mask, bitorder="little"))

    return _encode(numel, itemsize, len(positions), lambda: values, gaps, bits)


def smallest_encoding(numel: int, itemsize: int, count: int) -> str:
    """"dense", "positions16" or "bitmap": the smallest for `count` changes (ties go to
    the earlier; positions32 is chosen over positions16 only once the gaps are known)."""
    sizes = {enc: encoded_nbytes(enc, numel, itemsize, count) for enc in ("dense", "positions16", "bitmap")}
    return min(sizes, key=lambda e: sizes[e])  # dict order breaks ties: dense first


def _encode(numel: int, itemsize: int, count: int, values: Callable[[], torch.Tensor],
            gaps: Callable[[], torch.Tensor], bits: Callable[[], torch.Tensor]) -> Encoded:
    """The smallest encoding of `count` changes; `values`, `gaps` and `bits` are asked
    only for what that encoding needs."""
    best = smallest_encoding(numel, itemsize, count)
    if best == "dense":
        return Encoded("dense", count, None)
    if best == "bitmap":
        return Encoded("bitmap", count, _payload(values(), bits()))
    deltas = gaps()
    if count and int(deltas.max()) > _MAX_GAP16:  # a long gap: 32-bit gaps, unless the bitmap is smaller
        if encoded_nbytes("positions32", numel, itemsize, count) >= encoded_nbytes("bitmap", numel, itemsize, count):
            return Encoded("bitmap", count, _payload(values(), bits()))
        return Encoded("positions32", count, _payload(values(), deltas.to(torch.uint32)))
    return Encoded("positions16", count, _payload(values(), deltas.to(torch.uint16)))


def _payload(values: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """values' bytes, then tail's bytes, zero-padded to PAYLOAD_ALIGN; on the CPU."""
    raw = values.cpu().numpy().tobytes() + tail.cpu().numpy().tobytes()
    raw += bytes(-len(raw) % PAYLOAD_ALIGN)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def apply_payload(base: torch.Tensor, *, encoding: str, num_changed: int, payload: torch.Tensor,
                  hf_name: str = "?") -> torch.Tensor:
    """A new tensor: a copy of `base` with the changes in `payload` written in; `base`
    is left as it was. Raises IntegrityError (naming `hf_name`) for a payload that is
    not a well-formed `encoding` of `num_changed` changes to a tensor of base's shape."""
    numel, itemsize = base.numel(), base.dtype.itemsize
    want = encoded_nbytes(encoding, numel, itemsize, num_changed)
    if encoding == "dense" or payload.dtype != torch.uint8 or payload.numel() != want:
        raise IntegrityError(f"{hf_name}: a {encoding} payload of {num_changed} changes to {numel} elements takes "
                             f"{want} bytes, got {payload.numel()} {payload.dtype}")
    payload = payload.reshape(-1)
    out = base.detach().clone(memory_format=torch.contiguous_format)
    flat = bits_view(out)
    int_dtype = flat.dtype
    value_bytes = num_changed * itemsize
    values = payload[:value_bytes].clone().view(int_dtype)  # on the CPU, aligned (a fresh copy)
    if out.device.type != "cpu":
        values = values.to(out.device)
    if encoding in _GAP_DTYPES:
        width = _GAP_DTYPES[encoding].itemsize
        gaps = payload[value_bytes: value_bytes + num_changed * width].clone().view(_GAP_DTYPES[encoding])
        gaps = gaps.to(torch.int64)
        if num_changed and (bool((gaps[1:] <= 0).any()) or int(gaps.sum()) >= numel):
            raise IntegrityError(f"{hf_name}: positions are not strictly increasing within {numel} elements")
        positions = gaps.cumsum(0)
        if out.device.type == "cpu":
            flat.numpy()[positions.numpy()] = values.numpy()
        else:
            flat[positions.to(out.device)] = values
        return out
    bits = payload[value_bytes: value_bytes + (numel + 7) // 8]
    mask = np.unpackbits(bits.numpy(), bitorder="little").view(np.bool_)
    marked, past_end = int(np.count_nonzero(mask[:numel])), int(np.count_nonzero(mask[numel:]))
    if marked != num_changed or past_end:
        raise IntegrityError(f"{hf_name}: the bitmap marks {marked} element(s) (and {past_end} past the end), "
                             f"the manifest says {num_changed}")
    if out.device.type == "cpu":  # positions then a gather-assign: ~4x numpy's boolean assignment
        flat.numpy()[np.flatnonzero(mask[:numel])] = values.numpy()
    else:
        flat[torch.from_numpy(mask[:numel]).to(out.device)] = values
    return out


__all__ = ["ENCODINGS", "INT_OF_SIZE", "PAYLOAD_ALIGN", "Changes", "Encoded", "apply_payload", "bits_view",
           "changed", "encode", "encode_positions", "encoded_nbytes", "smallest_encoding"]
