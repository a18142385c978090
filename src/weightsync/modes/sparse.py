"""mode="sparse": only the elements whose engine-dtype bytes changed since the version every
engine acked, applied on top of it and verified by whole-tensor digests.

The mode keeps a SNAPSHOT of that version (one model copy in the engines' dtype, where
`ModeOptions.sparse_snapshot` says), diffs each cast tensor against it and encodes the changes
(`weightsync.change_encoding`); a push goes whole where no base can be proven. What it costs and
when it goes whole: docs/PERFORMANCE.md ("Sparse pushes") and docs/ARCHITECTURE.md's design
notes; a sharded trainer's ranks each diff their own rows (`modes.sparse_shards`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from weightsync.bucketing import TensorParts, check_cast
from weightsync.change_encoding import encode
from weightsync.digests import WSMIX64, digest
from weightsync.dtypes import Cast
from weightsync.errors import EngineError
from weightsync.manifest import TensorMeta
from weightsync.modes.base import ModeDefaults, ModeOptions, Planner, PushMode, Selection
from weightsync.modes.sparse_shards import ShardedSnapshot, SnapshotMemory
from weightsync.sources import ModuleSource, WeightSource
from weightsync.trainer_ranks import TrainerRanks

log = logging.getLogger(__name__)

SNAPSHOT_PLACES = ("trainer", "host")


class SparseMode(ModeDefaults):
    """Changed elements on top of the last acked version, whole-tensor digests acked."""

    name: ClassVar[str] = "sparse"
    digests_from_parts: ClassVar[bool] = True

    def __init__(self, options: ModeOptions | None = None) -> None:
        super().__init__(options)
        if self.options.sparse_snapshot not in SNAPSHOT_PLACES:
            raise ValueError(f"sparse_snapshot must be one of {SNAPSHOT_PLACES}, "
                             f"got {self.options.sparse_snapshot!r}")
        self.acked_version: int | None = None
        """The version every engine acked last, which the snapshot holds (None: none, or
        the last push failed or was refused)."""
        self.snapshot: dict[str, torch.Tensor] = {}
        """hf_name -> the tensor as the engines hold it at `acked_version` (engine dtype)."""
        self._full: tuple[int, Selection] | None = None
        """(version, the whole push of it) of the push under way: what a refusal sends."""
        self._memory = SnapshotMemory(self.options.sparse_snapshot)
        self._shards: ShardedSnapshot | None = None
        """A sharded trainer's: this rank's rows of the snapshot (instead of `snapshot`)."""

    def prepare(self, model: Any, version: int, planner: Planner) -> Sequence[PushMode]:
        self._full = None
        return ()

    def select(self, source: WeightSource, version: int, planner: Planner) -> Selection:
        if self._full is not None and self._full[0] == version:
            return self._full[1]  # asked again after a refusal: the snapshot is already this version
        base, self.acked_version = self.acked_version, None  # proven again only by this push's commit
        sparse = base is not None and all(c.supports_sparse for c in planner.capabilities)
        if planner.ranks.is_distributed:
            return self._select_sharded(source, version, planner, base if sparse else None)
        t0 = time.perf_counter()
        diff = self._diff(source, planner, sparse=sparse)
        planner.stages.diff += time.perf_counter() - t0
        full = Selection(mode="full", metas=list(source.metas()), stream=_Stream(source.mode, self.snapshot, {}))
        self._full = (version, full)
        if not sparse:
            return full
        return Selection(mode="sparse", metas=diff.metas, num_skipped=diff.num_unchanged, base_version=base,
                         stream=_Stream(source.mode, self.snapshot, diff.payloads))

    def refused(self, selection: Selection, error: EngineError) -> bool:
        if selection.mode != "sparse" or error.status != 409:
            return False
        log.info("sparse update refused (%s); sending the whole model instead", error)
        return True

    def committed(self, selection: Selection, version: int, planner: Planner) -> None:
        self.acked_version = version
        self._full = None

    def follow(self, model: Any, step: Mapping[str, Any], order: Sequence[str] | None, ranks: TrainerRanks,
               *, timeout_s: float) -> None:
        shards = self._shards_of(ranks)
        if "diff" in step:
            diff = step["diff"]
            source = self.source(model, expert_layout=diff.get("expert_layout", "per-expert"))
            shards.diff(_module_source(source), cast=Cast.from_dict(diff["cast"]), sparse=diff["sparse"],
                        allow_overflow=diff["allow_overflow"], timeout_s=timeout_s)
        elif "stream" in step and order is not None:
            for _ in shards.stream(order, {}, full=step["stream"] == "full", payloads={}, timeout_s=timeout_s):
                pass
        else:
            super().follow(model, step, order, ranks, timeout_s=timeout_s)

    def _select_sharded(self, source: WeightSource, version: int, planner: Planner, base: int | None) -> Selection:
        """`select` on the sending rank of a sharded trainer: every rank diffs its rows."""
        module = _module_source(source)
        cast = planner.cast
        sparse = base is not None
        planner.share_step({"diff": {"cast": cast.to_dict(), "sparse": sparse,
                                     "allow_overflow": planner.allow_overflow,
                                     "expert_layout": module.expert_layout}})
        shards = self._shards_of(planner.ranks)
        t0 = time.perf_counter()
        diff = shards.diff(module, cast=cast, sparse=sparse, allow_overflow=planner.allow_overflow,
                           timeout_s=planner.timeout_s)
        planner.stages.diff += time.perf_counter() - t0
        assert diff is not None  # the sender's
        metas = list(source.metas())
        shapes = {m.hf_name: tuple(m.shape) for m in metas}
        full = Selection(mode="full", metas=metas, follower_step={"stream": "full"},
                         stream=_ShardStream(source.mode, metas, shards, shapes, full=True, payloads={},
                                             timeout_s=planner.timeout_s))
        self._full = (version, full)
        if base is None:
            return full
        return Selection(mode="sparse", metas=diff.metas, num_skipped=diff.num_unchanged, base_version=base,
                         follower_step={"stream": "sparse"}, digest_algorithm=WSMIX64,
                         stream=_ShardStream(source.mode, metas, shards, shapes, full=False, payloads=diff.payloads,
                                             timeout_s=planner.timeout_s))

    def _shards_of(self, ranks: TrainerRanks) -> ShardedSnapshot:
        if self._shards is None:
            self._shards = ShardedSnapshot(ranks, self.options.sparse_snapshot)
        return self._shards

    def _diff(self, source: WeightSource, planner: Planner, *, sparse: bool) -> _Diff:
        """Read and cast every tensor, encode its change against the snapshot (with
        `sparse`), and write it into the snapshot."""
        cast = planner.cast
        algorithm = planner.digest_algorithm
        out = _Diff()
        for hf_name, tensor in source.tensors([m.hf_name for m in source.metas()]):
            if isinstance(tensor, TensorParts):
                raise ValueError(f"{hf_name} is stacked from per-expert tensors (sources.stacked) for an engine that "
                                 "loads experts fused; mode='sparse' diffs tensors the trainer holds whole: use "
                                 "mode='delta' (per fused tensor) or 'full'")
            tensor = tensor.detach()
            dtype = cast.of(hf_name, tensor.dtype)
            new = self._memory.cast(tensor, dtype)
            if dtype != tensor.dtype:
                check_cast(hf_name, tensor, new, allow_overflow=planner.allow_overflow)
            held = self.snapshot.get(hf_name)
            if held is None or held.shape != new.shape or held.dtype != new.dtype:
                held = self.snapshot[hf_name] = self._memory.keep(new)
                if sparse:
                    out.metas.append(TensorMeta(hf_name=hf_name, dtype=dtype, shape=tuple(new.shape),
                                                tensor_digest=digest(held, algorithm)))
                continue
            if not sparse:
                held.copy_(new)
                continue
            encoded = encode(new, held)
            if encoded.num_changed == 0:
                out.num_unchanged += 1
                continue
            held.copy_(new)
            out.metas.append(TensorMeta(hf_name=hf_name, dtype=dtype, shape=tuple(new.shape),
                                        encoding=encoded.encoding,
                                        num_changed=encoded.num_changed if encoded.payload is not None else 0,
                                        tensor_digest=digest(held, algorithm)))
            if encoded.payload is not None:
                out.payloads[hf_name] = encoded.payload
        return out


@dataclass
class _Diff:
    """One push's comparison with the snapshot."""

    metas: list[TensorMeta] = field(default_factory=list)
    """The tensors to send, with their encodings and whole-tensor digests."""
    payloads: dict[str, torch.Tensor] = field(default_factory=dict)
    """hf_name -> the uint8 payload of each sparse-encoded tensor."""
    num_unchanged: int = 0


class _ShardStream:
    """What the sending rank of a sharded trainer packs: payloads, and dense tensors
    gathered from every rank's rows while the others follow (`ShardedSnapshot.stream`)."""

    def __init__(self, mode: str, metas: Sequence[TensorMeta], shards: ShardedSnapshot,
                 shapes: dict[str, tuple[int, ...]], *, full: bool, payloads: dict[str, torch.Tensor],
                 timeout_s: float) -> None:
        self.mode = mode
        self._metas = metas
        self._shards, self._shapes, self._full, self._payloads = shards, shapes, full, payloads
        self._timeout_s = timeout_s

    def metas(self) -> Sequence[TensorMeta]:
        return self._metas

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        order = hf_names if hf_names is not None else list(self._shapes)
        return self._shards.stream(order, self._shapes, full=self._full, payloads=self._payloads,
                                   timeout_s=self._timeout_s)


def _module_source(source: WeightSource) -> ModuleSource:
    if not isinstance(source, ModuleSource):
        raise TypeError(f"mode='sparse' with a process_group diffs each rank's shard of an nn.Module; got a "
                        f"{type(source).__name__} (a StackedSource: per-expert tensors stacked for an engine that "
                        "loads experts fused; use mode='delta')")
    return source


class _Stream:
    """What the pipeline packs: each tensor's payload, or its cast tensor from the snapshot."""

    def __init__(self, mode: str, snapshot: dict[str, torch.Tensor], payloads: dict[str, torch.Tensor]) -> None:
        self.mode = mode
        self._snapshot = snapshot
        self._payloads = payloads

    def metas(self) -> Sequence[TensorMeta]:
        return [TensorMeta.of(n, t) for n, t in self._snapshot.items()]

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name in hf_names if hf_names is not None else list(self._snapshot):
            payload = self._payloads.get(hf_name)
            yield hf_name, payload if payload is not None else self._snapshot[hf_name]
