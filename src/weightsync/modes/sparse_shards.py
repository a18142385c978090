"""mode="sparse" on a sharded trainer (FSDP2): each rank diffs its own rows.

Every rank keeps its own rows of the snapshot (the acked version in the engines' dtype) and casts
and compares only those; nothing gathers a whole weight unless it goes dense. `modes/sparse.py`
uses it when a push has a process group: every rank makes the same collectives in the same order,
each bounded by `timeout_s`, and only the sender raises (for every rank). What crosses the process
group, step by step: docs/ARCHITECTURE.md, "Design notes, by module".
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from weightsync.bucketing import check_cast
from weightsync.change_encoding import INT_OF_SIZE, Changes, encode_positions, smallest_encoding
from weightsync.digests import MASK64, Wsmix64Part, combine_wsmix64, wsmix64_part
from weightsync.dtypes import Cast, dtype_name
from weightsync.errors import CastError
from weightsync.manifest import TensorMeta
from weightsync.sources.fsdp import local_shard
from weightsync.sources.module import ModuleSource
from weightsync.trainer_ranks import TrainerRanks

log = logging.getLogger(__name__)

_NUMEL, _COUNT, _FRESH, _OVERFLOW = range(4)
"""Columns of the table every rank contributes a row of per tensor."""
_NO_WORD = -1
"""A word index in the digest table: no shared word."""


class SnapshotMemory:
    """Where a snapshot lives ("trainer": each tensor's device; "host": CPU memory, pinned
    when CUDA is present), and the scratch buffers casts go into before comparing."""

    def __init__(self, place: str) -> None:
        self.place = place
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        """(device, dtype) -> a buffer the size of the largest tensor cast so far."""

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`tensor` cast to `dtype` into a scratch buffer kept across pushes, on the
        snapshot's side: a fresh allocation per tensor and push costs more in page faults
        than the cast itself. Valid until the next call."""
        device = torch.device("cpu") if self.place == "host" else tensor.device
        scratch = self._scratch.get((device, dtype))
        if scratch is None or scratch.numel() < tensor.numel():
            scratch = self._scratch[(device, dtype)] = torch.empty(tensor.numel(), dtype=dtype, device=device)
        new = scratch[: tensor.numel()].view(tensor.shape)
        new.copy_(tensor)
        return new

    def keep(self, new: torch.Tensor) -> torch.Tensor:
        """A copy of `new` to hold as the snapshot."""
        held = new.clone()
        return held.pin_memory() if self.place == "host" and torch.cuda.is_available() else held


@dataclass
class ShardedDiff:
    """One push's comparison, on the sender: what to send."""

    metas: list[TensorMeta] = field(default_factory=list)
    """The tensors to send (engine dtype), with encodings and whole-tensor digests."""
    payloads: dict[str, torch.Tensor] = field(default_factory=dict)
    """hf_name -> the uint8 payload of each sparse-encoded tensor."""
    num_unchanged: int = 0


@dataclass
class _Plan:
    """What every rank derived, identically, from the gathered table."""

    names: list[str]
    numels: np.ndarray[Any, Any]
    """[rank, tensor]: elements of the tensor each rank holds."""
    counts: np.ndarray[Any, Any]
    """[rank, tensor]: changed elements on each rank."""
    kinds: list[str]
    """Per tensor: "unchanged", "sparse" or "dense"."""

    @property
    def offsets(self) -> np.ndarray[Any, Any]:
        """[rank, tensor]: the flat position each rank's rows start at."""
        return np.cumsum(self.numels, axis=0) - self.numels


class ShardedSnapshot:
    """One rank's rows of the snapshot, and its part of each push's collectives."""

    def __init__(self, ranks: TrainerRanks, place: str) -> None:
        self.ranks = ranks
        self.rows: dict[str, torch.Tensor] = {}
        """hf_name -> this rank's rows of the tensor as the engines hold it (flat); plain
        tensors only on the sender, whole."""
        self._plan: _Plan | None = None
        self.memory = SnapshotMemory(place)

    def diff(self, source: ModuleSource, *, cast: Cast, sparse: bool, allow_overflow: bool,
             timeout_s: float) -> ShardedDiff | None:
        """Cast and compare this rank's rows, update them, and (sender) return what to
        send; None on the other ranks. Every rank of the group calls it at once."""
        ranks = self.ranks
        metas = list(source.metas())
        table = np.zeros((len(metas), 4), dtype=np.int64)
        changes: dict[str, tuple[np.ndarray[Any, Any], torch.Tensor]] = {}
        dtypes: list[torch.dtype] = []
        overflow: str | None = None
        for i, meta in enumerate(metas):
            param = source.param(meta.hf_name).detach()
            rows = local_shard(param, meta.hf_name, rank=ranks.rank, world_size=ranks.world_size)
            if rows is None:  # a plain tensor: the sender's
                rows = param if ranks.is_sender else param.new_empty(0)
            dtype = cast.of(meta.hf_name, rows.dtype)
            dtypes.append(dtype)
            new = self.memory.cast(rows, dtype).view(-1)
            if dtype != rows.dtype and rows.numel():
                try:
                    check_cast(meta.hf_name, rows.reshape(-1), new, allow_overflow=allow_overflow)
                except CastError as e:
                    table[i, _OVERFLOW] = 1
                    overflow = overflow or str(e)
            table[i, _NUMEL] = new.numel()
            held = self.rows.get(meta.hf_name)
            if held is None or held.shape != new.shape or held.dtype != new.dtype:
                self.rows[meta.hf_name] = self.memory.keep(new)
                table[i, _FRESH] = 1
            elif sparse:
                found = Changes(new, held)
                table[i, _COUNT] = found.count
                if found.count:
                    changes[meta.hf_name] = (found.positions(), found.values())
                    held.copy_(new)
            else:
                held.copy_(new)
        gathered = ranks.all_gather(torch.from_numpy(table), timeout_s=timeout_s).numpy()
        plan = self._plan = _derive(metas, dtypes, gathered, sparse=sparse)
        if gathered[:, :, _OVERFLOW].any():
            if overflow is not None:
                log.warning("trainer rank %d: %s", ranks.rank, overflow)
            if not ranks.is_sender:
                return None
            raise CastError(overflow or _overflow_message(metas, gathered, dtypes))
        if not sparse:
            return ShardedDiff() if ranks.is_sender else None
        digests = self._digests(plan, dtypes, timeout_s)
        values = self._gather_changes(plan, dtypes, changes, timeout_s)
        if not ranks.is_sender:
            return None
        out = ShardedDiff()
        for i, meta in enumerate(metas):
            kind = plan.kinds[i]
            if kind == "unchanged":
                out.num_unchanged += 1
                continue
            entry = TensorMeta(hf_name=meta.hf_name, dtype=dtypes[i], shape=tuple(meta.shape),
                               tensor_digest=digests[i])
            if kind == "sparse":
                positions, new_values = values[meta.hf_name]
                encoded = encode_positions(meta.numel, dtypes[i].itemsize, positions, new_values)
                assert encoded.payload is not None  # `kinds` left dense what would be
                out.payloads[meta.hf_name] = encoded.payload
                entry = TensorMeta(hf_name=meta.hf_name, dtype=dtypes[i], shape=tuple(meta.shape),
                                   encoding=encoded.encoding, num_changed=encoded.num_changed,
                                   tensor_digest=digests[i])
            out.metas.append(entry)
        return out

    def stream(self, order: Sequence[str], shapes: dict[str, tuple[int, ...]], *, full: bool,
               payloads: dict[str, torch.Tensor], timeout_s: float) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of `order` for the pipeline: payloads of sparse tensors, and dense
        tensors gathered from every rank's rows (`full`: every tensor dense). Every
        rank iterates it at once; only the sender's yields anything."""
        plan = self._plan
        assert plan is not None, "stream() before diff()"
        index = {name: i for i, name in enumerate(plan.names)}
        send = self.ranks.send_rank
        for name in order:
            i = index[name]
            if not full and plan.kinds[i] == "sparse":
                if self.ranks.is_sender:
                    yield name, payloads[name]
                continue
            numels = plan.numels[:, i]
            if not np.delete(numels, send).any():  # all of it on the sender: nothing to gather
                if self.ranks.is_sender:
                    yield name, self.rows[name].view(shapes[name])
                continue
            mine = self.rows[name]
            padded = mine.new_zeros(int(numels.max()))
            padded[: mine.numel()] = mine
            parts = self.ranks.gather(self._to_comm(padded), timeout_s=timeout_s)
            if self.ranks.is_sender:
                whole = torch.cat([p[:n] for p, n in zip(parts, numels.tolist(), strict=True)])
                yield name, whole.to(mine.device).view(shapes[name])

    # -- collectives of a sparse push ----------------------------------------

    def _digests(self, plan: _Plan, dtypes: list[torch.dtype], timeout_s: float) -> list[str | None]:
        """wsmix64 of every sent tensor as a whole (None where unchanged); on the sender."""
        parts = np.full((len(plan.names), 5), _NO_WORD, dtype=np.int64)
        parts[:, 0] = 0
        offsets = plan.offsets[self.ranks.rank]
        for i, name in enumerate(plan.names):
            rows = self.rows.get(name)
            if plan.kinds[i] == "unchanged" or rows is None or not rows.numel():
                continue
            part = wsmix64_part(rows, int(offsets[i]) * dtypes[i].itemsize)
            parts[i, 0] = _signed(part.total)
            for k, (word, value) in enumerate(part.edges):
                parts[i, 1 + 2 * k], parts[i, 2 + 2 * k] = word, _signed(value)
        gathered = self.ranks.all_gather(torch.from_numpy(parts), timeout_s=timeout_s).numpy()
        out: list[str | None] = []
        for i in range(len(plan.names)):
            if plan.kinds[i] == "unchanged":
                out.append(None)
                continue
            nbytes = int(plan.numels[:, i].sum()) * dtypes[i].itemsize
            out.append(combine_wsmix64((_part(row) for row in gathered[:, i]), nbytes))
        return out

    def _gather_changes(self, plan: _Plan, dtypes: list[torch.dtype],
                        changes: dict[str, tuple[np.ndarray[Any, Any], torch.Tensor]],
                        timeout_s: float) -> dict[str, tuple[np.ndarray[Any, Any], torch.Tensor]]:
        """hf_name -> (whole-tensor positions, values) of every sparse tensor, from every
        rank; on the sender. One buffer per rank: per sparse tensor, values then positions."""
        sparse = [i for i, kind in enumerate(plan.kinds) if kind == "sparse"]
        widths = {i: dtypes[i].itemsize + 8 for i in sparse}
        sizes = [sum(int(plan.counts[r, i]) * widths[i] for i in sparse) for r in range(self.ranks.world_size)]
        offsets = plan.offsets[self.ranks.rank]
        pieces: list[bytes] = []
        for i in sparse:
            found = changes.get(plan.names[i])
            if found is not None:
                positions, values = found
                pieces += [values.cpu().numpy().tobytes(), (positions + offsets[i]).astype("<i8").tobytes()]
        mine = b"".join(pieces)
        assert len(mine) == sizes[self.ranks.rank]
        buffer = torch.zeros(max(sizes), dtype=torch.uint8)
        if mine:
            buffer[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        parts = [p.cpu().numpy() for p in self.ranks.gather(self._to_comm(buffer), timeout_s=timeout_s)]
        out: dict[str, tuple[np.ndarray[Any, Any], torch.Tensor]] = {}
        if not self.ranks.is_sender:
            return out
        read = [0] * self.ranks.world_size
        for i in sparse:
            count = [int(c) for c in plan.counts[:, i]]
            item = dtypes[i].itemsize
            value_bytes: list[np.ndarray[Any, Any]] = []
            position_words: list[np.ndarray[Any, Any]] = []
            for r, part in enumerate(parts):
                start = read[r]
                value_bytes.append(part[start: start + count[r] * item])
                position_words.append(part[start + count[r] * item: start + count[r] * widths[i]].view("<i8"))
                read[r] = start + count[r] * widths[i]
            out[plan.names[i]] = (np.concatenate(position_words).astype(np.int64),
                                  torch.from_numpy(np.concatenate(value_bytes).copy()).view(INT_OF_SIZE[item]))
        return out

    def _to_comm(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` where the group's backend takes it: CUDA for NCCL, else the CPU."""
        group = self.ranks.group
        if group is not None and dist.get_backend(group) == "nccl":
            return tensor.cuda()
        return tensor.cpu()


def _derive(metas: Sequence[TensorMeta], dtypes: Sequence[torch.dtype], table: np.ndarray[Any, Any],
            *, sparse: bool) -> _Plan:
    """The plan every rank derives from the gathered table ([rank, tensor, column])."""
    numels, counts = table[:, :, _NUMEL], table[:, :, _COUNT]
    kinds: list[str] = []
    for i, meta in enumerate(metas):
        numel, count = int(numels[:, i].sum()), int(counts[:, i].sum())
        if numel != meta.numel:
            raise ValueError(f"{meta.hf_name}: the trainer ranks hold {numel} of its {meta.numel} elements; "
                             "mode='sparse' with a process_group takes FSDP2's layout only")
        if not sparse or table[:, i, _FRESH].any():
            kinds.append("dense")
        elif count == 0:
            kinds.append("unchanged")
        else:
            dense = smallest_encoding(numel, dtypes[i].itemsize, count) == "dense"
            kinds.append("dense" if dense else "sparse")
    return _Plan(names=[m.hf_name for m in metas], numels=numels, counts=counts, kinds=kinds)


def _overflow_message(metas: Sequence[TensorMeta], table: np.ndarray[Any, Any], dtypes: Sequence[torch.dtype]) -> str:
    where = [(i, r) for r, i in zip(*np.nonzero(table[:, :, _OVERFLOW]), strict=True)]
    listed = ", ".join(f"{metas[i].hf_name!r} to {dtype_name(dtypes[i])} on trainer rank {r}" for i, r in where[:5])
    return (f"casting overflows: {listed} (that rank's log names the "
            "values); send a dtype with more range (dtype=torch.bfloat16) or pass allow_overflow=True to accept "
            "infinities")


def _signed(value: int) -> int:
    """A 64-bit pattern as an int64."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _part(row: np.ndarray[Any, Any]) -> Wsmix64Part:
    """A rank's gathered digest row back as its part."""
    edges = tuple((int(row[1 + 2 * k]), int(row[2 + 2 * k]) & MASK64) for k in range(2)
                  if row[1 + 2 * k] != _NO_WORD)
    return Wsmix64Part(total=int(row[0]) & MASK64, edges=edges)


__all__ = ["ShardedDiff", "ShardedSnapshot", "SnapshotMemory"]
