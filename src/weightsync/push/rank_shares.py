"""Every trainer rank sends its own share of each bucket (`SyncConfig.send_shares`).

Under FSDP2 nothing is gathered to the sending rank: the sender plans and begins, tells the other
ranks the buckets (`ShareOrder`), then every rank runs `send_shares` (handed to `push/fanout/shares.py`
and `push/followers.py`), making the same collectives in the same order, or the ranks deadlock. A
rank that fails does not raise alone: the sender raises for all. The engines join the shares into
buckets (`formats.shares`). The collectives, step by step: docs/ARCHITECTURE.md, "Design notes".
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from weightsync.bucketing import check_cast
from weightsync.digests import MASK64, Wsmix64Part, combine_wsmix64, wsmix64_part
from weightsync.dtypes import castable
from weightsync.errors import CastError, WeightSyncError
from weightsync.formats.shares import Share, merge_ranges
from weightsync.integrity import byte_view
from weightsync.manifest import BucketMeta, Manifest
from weightsync.push.pipeline import Handoff
from weightsync.reports import Stages
from weightsync.sources.fsdp import local_shard
from weightsync.trainer_ranks import TrainerRanks

Deliver = Callable[[Share], None]
IN_FLIGHT = 2
"""Shares of one rank being sent at once (each in a buffer of its own, plus the one being packed)."""


@dataclass(frozen=True, kw_only=True)
class ShareOrder:
    """What the sending rank tells the others to send: the push's buckets, as planned."""

    version: int
    buckets: tuple[BucketMeta, ...]
    """The manifest's buckets (engine names, sent dtypes, offsets), without digests."""
    to_source: Mapping[str, str] | None = None
    """Engine name -> the source's name, where they differ (`SyncConfig.rename`)."""

    @classmethod
    def of(cls, manifest: Manifest, to_engine: Mapping[str, str]) -> ShareOrder:
        """The order of `manifest`'s buckets; `to_engine`: the source's names -> the engines'."""
        renamed = {engine: name for name, engine in to_engine.items() if engine != name}
        return cls(version=manifest.version, buckets=manifest.buckets, to_source=renamed or None)

    def to_message(self) -> dict[str, Any]:
        return {"version": self.version, "buckets": [b.to_dict() for b in self.buckets],
                "to_source": dict(self.to_source) if self.to_source else None}

    @classmethod
    def from_message(cls, d: Mapping[str, Any]) -> ShareOrder:
        return cls(version=int(d["version"]), buckets=tuple(BucketMeta.from_dict(b) for b in d["buckets"]),
                   to_source=d.get("to_source"))


@runtime_checkable
class ShareSource(Protocol):
    """What `send_shares` reads: each tensor as the model holds it, an FSDP2 parameter as
    this rank's DTensor (`sources.ModuleSource.param`)."""

    def param(self, hf_name: str) -> torch.Tensor:
        ...


def send_shares(source: object, order: ShareOrder, ranks: TrainerRanks, *, deliver: Deliver, timeout_s: float,
                allow_overflow: bool = False, stages: Stages | None = None,
                buffers: list[torch.Tensor] | None = None) -> list[str] | None:
    """This rank's part of a push sent in shares (see the module docstring); every rank
    of `ranks` calls it at once. Returns the buckets' whole digests on the sender, None
    on the others; the sender raises (WeightSyncError, CastError) where any rank failed.
    `buffers`: the reused buffers, kept by the caller across pushes (a fresh buffer
    page-faults on its first write: 0.1 s per 62 MB here)."""
    if not isinstance(source, ShareSource):
        raise ValueError(f"send_shares=True reads each rank's rows of the model's parameters: push the model "
                         f"(an nn.Module), not a {type(source).__name__}")
    stages = stages or Stages()
    rows, starts = _layout(source, order, ranks, timeout_s)
    if buffers is None:
        buffers = []
    buffers.extend(torch.empty(0, dtype=torch.uint8) for _ in range(IN_FLIGHT + 1 - len(buffers)))

    def pack(bucket: BucketMeta, slot: int) -> tuple[tuple[tuple[int, int], ...], torch.Tensor]:
        mine = sum(rows[e.hf_name].numel() * e.dtype.itemsize for e in bucket.entries)
        if buffers[slot].numel() < mine:
            buffers[slot] = torch.empty(mine, dtype=torch.uint8)
        return _pack(bucket, rows, starts, buffers[slot][:mine])

    # 1. the whole digest of every bucket, from every rank's terms, before a byte is sent
    t0 = time.perf_counter()
    terms, error = [], None
    for bucket in order.buckets:
        bucket_terms, overflow = _terms(bucket, rows, starts, allow_overflow=allow_overflow)
        terms.append(bucket_terms)
        error = error or overflow
    stages.hash += time.perf_counter() - t0
    answers = ranks.all_gather_json({"terms": terms, "error": error}, timeout_s=timeout_s)
    stopped = [(r, a["error"]) for r, a in enumerate(answers) if a["error"]]
    digests = [combine_wsmix64((_part(t) for a in answers for t in a["terms"][k]), bucket.nbytes)
               for k, bucket in enumerate(order.buckets)] if not stopped else []

    # 2. the shares, packed on a thread of their own while this one sends the ones before:
    # IN_FLIGHT shares sent at once (the link stays busy while an engine takes the last one)
    free = threading.Semaphore(IN_FLIGHT + 1)

    def produce(put: Callable[[Share], None], stop: threading.Event) -> None:
        for k, bucket in enumerate(order.buckets):
            while not free.acquire(timeout=0.1):
                if stop.is_set():
                    return
            t1 = time.perf_counter()
            ranges, data = pack(bucket, k % (IN_FLIGHT + 1))
            stages.pack += time.perf_counter() - t1
            put(Share(version=order.version, index=bucket.index, digest=digests[k], ranges=ranges, data=data))

    failed: list[str] = []

    def send(share: Share) -> None:
        try:
            if share.ranges and not failed:
                deliver(share)
        except Exception as e:  # told to every rank below
            failed.append(f"{type(e).__name__}: {e}")

    if not stopped:
        t1 = time.perf_counter()
        with Handoff(produce, name="weightsync-shares") as packed, \
                ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="weightsync-share") as pool:
            sending: deque[Future[None]] = deque()
            for share in packed:
                if len(sending) == IN_FLIGHT:  # the oldest first: buffers are reused in bucket order
                    sending.popleft().result()
                    free.release()
                sending.append(pool.submit(send, share))
            for future in sending:
                future.result()
        stages.wire += time.perf_counter() - t1
        # 3. how it went on every rank
        answers = ranks.all_gather_json({"error": failed[0] if failed else None}, timeout_s=timeout_s)
        stopped = [(r, a["error"]) for r, a in enumerate(answers) if a["error"]]
    if not ranks.is_sender:
        return None
    if stopped:
        rank, why = stopped[0]
        kind = CastError if why.startswith(f"{CastError.__name__}:") else WeightSyncError
        raise kind(f"trainer rank {rank} could not send its share: {why}")
    return digests


def _layout(source: ShareSource, order: ShareOrder, ranks: TrainerRanks,
            timeout_s: float) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """This rank's rows of every tensor of the order (flat; empty where it holds none) and
    the element each starts at in the whole tensor, from one all_gather of the counts."""
    entries = [e for b in order.buckets for e in b.entries]
    to_source = order.to_source or {}
    rows: dict[str, torch.Tensor] = {}
    for entry in entries:
        name = to_source.get(entry.hf_name, entry.hf_name)
        held = source.param(name).detach()
        mine = local_shard(held, name, rank=ranks.rank, world_size=ranks.world_size)
        if mine is None:  # a plain tensor: the sender's
            mine = held if ranks.is_sender else held.new_empty(0)
        rows[entry.hf_name] = mine.reshape(-1)
    counts = torch.tensor([rows[e.hf_name].numel() for e in entries], dtype=torch.int64)
    table = ranks.all_gather(counts, timeout_s=timeout_s)  # [rank, tensor]
    totals = table.sum(dim=0)
    starts: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if int(totals[i]) != entry.numel:
            raise ValueError(f"{entry.hf_name}: the trainer ranks hold {int(totals[i])} of its {entry.numel} "
                             "elements; send_shares takes FSDP2's layout only (Shard(0) over the process group's "
                             "ranks, or a tensor every rank holds whole)")
        starts[entry.hf_name] = int(table[: ranks.rank, i].sum())
    return rows, starts


def _terms(bucket: BucketMeta, rows: Mapping[str, torch.Tensor], starts: Mapping[str, int], *,
           allow_overflow: bool) -> tuple[list[list[Any]], str | None]:
    """The wsmix64 terms (JSON-able) of this rank's rows of `bucket`, cast to the engines' dtype,
    where they lie in the bucket; and an overflowing cast as text, or None."""
    terms, error = [], None
    for entry in bucket.entries:
        mine = rows[entry.hf_name]
        if not mine.numel():
            continue
        cast = mine if mine.dtype == entry.dtype else mine.to(entry.dtype)
        if cast is not mine and castable(mine.dtype, entry.dtype) and error is None:
            try:
                check_cast(entry.hf_name, mine, cast, allow_overflow=allow_overflow)
            except CastError as e:
                error = f"{CastError.__name__}: {e}"
        part = wsmix64_part(cast, entry.offset + starts[entry.hf_name] * entry.dtype.itemsize)
        terms.append([part.total, [list(edge) for edge in part.edges]])
    return terms, error


def _pack(bucket: BucketMeta, rows: Mapping[str, torch.Tensor], starts: Mapping[str, int],
          into: torch.Tensor) -> tuple[tuple[tuple[int, int], ...], torch.Tensor]:
    """This rank's rows of `bucket`, cast exactly as `tensor.to(dtype)` and packed into `into`:
    (their ranges in the bucket, touching ones joined; their bytes)."""
    ranges: list[tuple[int, int]] = []
    at = 0
    for entry in bucket.entries:
        mine = rows[entry.hf_name]
        if not mine.numel():
            continue
        nbytes = mine.numel() * entry.dtype.itemsize
        into[at: at + nbytes].copy_(byte_view(mine.to(entry.dtype).contiguous()))
        ranges.append((entry.offset + starts[entry.hf_name] * entry.dtype.itemsize, nbytes))
        at += nbytes
    return merge_ranges(ranges), into[:at]


def _part(term: Sequence[Any]) -> Wsmix64Part:
    total, edges = term
    return Wsmix64Part(total=int(total) & MASK64, edges=tuple((int(i), int(w) & MASK64) for i, w in edges))


__all__ = ["ShareOrder", "send_shares"]
