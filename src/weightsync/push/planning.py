"""The plan of a push, before any byte moves: the dtype floating tensors travel in, the
expert layout the engines load, the buckets (reused while a push selects the same
tensors), and what a mode may ask of the coordinator while it chooses (`PushPlanner`,
the `modes.base.Planner` of one phase of a push).

Everything here is planned from what the session's handshake answered
(`Replicas.handshake`), passed in as plain values (`Casts`, the expert layout, the
digest algorithm): nothing here asks an engine what it can do, or calls back into the
coordinator for it."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from weightsync.bucketing import TensorParts, plan_buckets
from weightsync.digests import XXH3_64, hasher
from weightsync.dtypes import Cast, dtype_name
from weightsync.engines.base import AdapterUnloader, EngineCapabilities
from weightsync.errors import CastError, format_names
from weightsync.formats.quantized import Quantization, is_plain_castable_target, quantized_dtypes
from weightsync.integrity import digest
from weightsync.manifest import BucketMeta, Manifest, TensorMeta
from weightsync.modes import Selection
from weightsync.naming import ExpertLayout, expert_stacks, has_fused_experts, rename
from weightsync.push.packer import stream_order
from weightsync.push.replicas import Replicas
from weightsync.reports import Stages
from weightsync.sources import WeightSource
from weightsync.trainer_ranks import TrainerRanks


def _digest_as_sent(hf_name: str, tensor: torch.Tensor | TensorParts, cast: Cast) -> str:
    """The digest of `tensor` as it travels (cast as `cast` says for `hf_name`); one given as its
    parts is hashed part by part, each cast as it is packed, never made whole."""
    if isinstance(tensor, TensorParts):
        hashed = hasher(XXH3_64)
        for _, part in tensor:
            hashed.update(part.to(cast.of(hf_name, part.dtype)))
        return hashed.hexdigest()
    return digest(tensor.to(cast.of(hf_name, tensor.dtype)).contiguous())


@dataclass(frozen=True, kw_only=True)
class Casts:
    """What the dtype floating tensors travel in is chosen from (`cast_dtype`), as plain values."""

    forced: torch.dtype | None = None
    """`SyncConfig.dtype`: the dtype the user forces (None: the engines')."""
    served: Mapping[str, EngineCapabilities] = field(default_factory=dict)
    """Engine label -> what it declared at the session's handshake."""
    to_engine: Mapping[str, str] | None = None
    """hf_name -> engine name where renamed (`SyncConfig.rename`)."""

    def of(self, *, cast: bool) -> Cast:
        """The dtype each floating tensor travels in, for a mode that casts (`cast`) or not."""
        return cast_dtype(self.forced, self.served, cast=cast, to_engine=self.to_engine,
                          quantization=self.quantization(cast=cast))

    def quantization(self, *, cast: bool) -> Quantization | None:
        """What the engines serve quantized, for a mode that casts (a mode that does not, "lora",
        sends no base weights: None); None where they serve floats. Refuses replicas that
        disagree and a forced dtype into a quantized engine."""
        return served_quantization(self.served, cast=cast, forced=self.forced)


def served_quantization(served: Mapping[str, EngineCapabilities], *, cast: bool,
                        forced: torch.dtype | None) -> Quantization | None:
    """The one quantization the engines declare (`EngineCapabilities.quantization`), or None."""
    declared = {label: c.quantization for label, c in served.items()}
    quantized = {label: q for label, q in declared.items() if q is not None}
    if not quantized:
        return None
    if len({repr(q.to_dict()) for q in declared.values() if q is not None}) != 1 or len(quantized) != len(declared):
        listed = ", ".join(f"{label} serves {q.format.kind if q else 'floats'}" for label, q in declared.items())
        raise CastError(f"engine replicas serve different weight formats ({listed}); push to each kind of engine "
                        "with its own WeightSync")
    label, quantization = next(iter(quantized.items()))
    if forced is not None:
        raise CastError(f"{label} serves quantized weights ({quantization.format.kind}); dtype={dtype_name(forced)} "
                        "would send them unquantized: leave dtype unset (weightsync quantizes in the stream)")
    return quantization if cast else None


def cast_dtype(forced: torch.dtype | None, served: Mapping[str, EngineCapabilities], *,
               cast: bool, to_engine: Mapping[str, str] | None = None,
               quantization: Quantization | None = None) -> Cast:
    """The dtype each floating tensor travels in: `forced` (`SyncConfig.dtype`), else with `cast`
    the one dtype the engines serve; either way, a tensor the engines keep in another dtype
    (`EngineCapabilities.kept_dtypes`, a router's float32 bias) travels in that one. `served`:
    engine label -> its capabilities; `to_engine`: hf_name -> engine name where renamed. Replicas
    must agree; checked before any byte moves. With `quantization`, the quantized weights and their
    scales travel as the quantizer made them (`push.quantize`). A plain cast never makes float8 or
    integer weights: that needs a scale."""
    capabilities = served if cast or forced is not None else {}
    for label, dtype in [("dtype=", forced), *((f"{label} serves", c.dtype) for label, c in capabilities.items())]:
        if dtype is not None and not is_plain_castable_target(dtype):
            raise CastError(f"{label} {dtype_name(dtype)}: a plain cast to it drops the scales float8 and integer "
                            "weights need; start the engine from a quantized checkpoint (its quantization_config) "
                            "and weightsync quantizes in the stream")
    kept_by: dict[str, dict[str, torch.dtype]] = {label: dict(c.kept_dtypes) for label, c in capabilities.items()}
    if len({tuple(sorted((n, dtype_name(d)) for n, d in k.items())) for k in kept_by.values()}) > 1:
        listed = "; ".join(f"{label} keeps {', '.join(f'{n} in {dtype_name(d)}' for n, d in sorted(k.items())[:4])}"
                           if k else f"{label} keeps none" for label, k in kept_by.items())
        raise CastError(f"engine replicas keep different tensors in another dtype than they serve ({listed}); "
                        "push to each kind of engine with its own WeightSync")
    kept_engine = next(iter(kept_by.values()), {})
    if quantization is not None:
        kept_engine = {**kept_engine, **quantized_dtypes(quantization)}
    if kept_engine and to_engine:
        to_hf = {engine_name: hf_name for hf_name, engine_name in to_engine.items()}
        kept = {to_hf.get(n, n): d for n, d in kept_engine.items()}
    else:
        kept = kept_engine
    if forced is not None:
        return Cast(to=forced, kept=kept)
    if not cast:
        return Cast()
    known = {label: c.dtype for label, c in capabilities.items() if c.dtype is not None}
    if len(set(known.values())) > 1:
        listed = ", ".join(f"{label} serves {dtype_name(d)}" for label, d in known.items())
        raise CastError(f"engine replicas serve different dtypes ({listed}); start them with one dtype, "
                        "or pass dtype= to send one (an engine that cannot take it refuses at begin)")
    return Cast(to=next(iter(known.values()), None), kept=kept)


def cast_notes(cast: Cast, metas: Sequence[TensorMeta], held: Mapping[str, torch.dtype]) -> list[str]:
    """A push report's notes on what was cast in the stream (`metas`: what was sent; `held`:
    hf_name -> the dtype the trainer holds it in, where that differs from the meta's)."""
    cast_from: set[str] = set()
    kept: dict[str, list[str]] = {}
    for m in metas:
        held_as = held.get(m.hf_name, m.dtype)
        sent = cast.of(m.hf_name, held_as)
        if m.hf_name in cast.kept and sent != cast.to:
            kept.setdefault(dtype_name(sent), []).append(m.hf_name)
        elif sent != held_as:
            cast_from.add(dtype_name(held_as))
    notes = []
    if cast.to is not None and cast_from:
        listed = ", ".join(sorted(cast_from))
        notes.append(f"floating tensors cast from {listed} to {dtype_name(cast.to)} in the stream")
    for dtype, names in sorted(kept.items()):
        notes.append(f"{len(names)} tensor(s) sent in {dtype}, as the engines keep them: {format_names(names)}")
    return notes


def expert_layout(layouts: Mapping[str, ExpertLayout], model: Any) -> ExpertLayout:
    """The expert layout the engines load (engine label -> `EngineCapabilities.expert_layout`);
    replicas must agree where the model holds experts the layout names (fused, or per-expert
    ones that stack into fused tensors); elsewhere it names nothing."""
    if len(set(layouts.values())) > 1 and isinstance(model, nn.Module) and (
            has_fused_experts(model) or expert_stacks(model)):
        listed = ", ".join(f"{label} loads {layout}" for label, layout in layouts.items())
        raise ValueError(f"engine replicas load Mixture-of-Experts layers in different layouts ({listed}); "
                         "push to each kind with its own WeightSync")
    return next(iter(layouts.values()), "per-expert")


@dataclass(frozen=True)
class _PlanKey:
    """What a bucket plan depends on besides the config: equal keys, equal plans."""

    hf_names: list[str]
    """Every tensor of the source (the rename covers them all)."""
    metas: list[TensorMeta]
    """The tensors selected, as the trainer holds them."""
    cast: Cast
    bucket_bytes: int
    in_one_bucket: bool


@dataclass(frozen=True)
class BucketPlan:
    """The selected tensors as the engines receive them, cut into buckets."""

    to_engine: dict[str, str]
    """hf_name -> engine name, for the whole source."""
    buckets: tuple[BucketMeta, ...]
    order: list[str]
    """hf_names in stream order."""


class BucketPlanner:
    """Cuts a selection into buckets, and reuses the last plan while a push selects the same
    tensors (names, dtypes, shapes, encodings), as an RL loop's full pushes do step after step."""

    def __init__(self, rename: Mapping[str, str] | None) -> None:
        self._rename = dict(rename or {})
        self.last: tuple[_PlanKey, BucketPlan] | None = None
        """The last plan and its key; plans are immutable, never changed by callers."""

    def plan(self, held: Mapping[str, torch.dtype], metas: Sequence[TensorMeta], *, cast: Cast,
             bucket_bytes: int, in_one_bucket: bool) -> BucketPlan:
        """`metas` (the selection, trainer names and dtypes) renamed and cast for the engines and
        cut into buckets of `bucket_bytes` (one bucket with `in_one_bucket`); `held`: every
        tensor of the source -> its dtype as the trainer holds it."""
        key = _PlanKey(hf_names=list(held), metas=list(metas), cast=cast, bucket_bytes=bucket_bytes,
                       in_one_bucket=in_one_bucket)
        if self.last is not None and self.last[0] == key:
            return self.last[1]
        # renamed for the whole source, so a rename entry of a tensor left out is not stale
        to_engine = rename(held, self._rename)
        engine_metas = [replace(m, hf_name=to_engine[m.hf_name], dtype=cast.of(m.hf_name, m.dtype)) for m in metas]
        if in_one_bucket:
            bucket_bytes = max(1, sum(m.nbytes for m in engine_metas))
        buckets = plan_buckets(engine_metas, bucket_bytes)
        to_hf = {v: k for k, v in to_engine.items()}
        plan = BucketPlan(to_engine=to_engine, buckets=tuple(buckets), order=[to_hf[n] for n in stream_order(buckets)])
        self.last = (key, plan)
        return plan


class PushPlanner:
    """What a mode plans one phase of a push with (`modes.base.Planner`): the plain values the
    push is planned with (the handshake's capabilities, the mode's `cast`, the digest algorithm,
    the expert layout), and the rounds a mode may start (hashing along every trainer rank,
    reading served digests, unloading adapters)."""

    def __init__(self, replicas: Replicas, ranks: TrainerRanks, *, stages: Stages, allow_overflow: bool,
                 digest_algorithm: str, capabilities: Sequence[EngineCapabilities], casts: Casts, cast: Cast,
                 expert_layout: ExpertLayout) -> None:
        self._replicas = replicas
        self.ranks = ranks
        self.stages = stages
        self.pool: Executor = replicas.pool
        self.timeout_s = replicas.timeout_s
        self.allow_overflow = allow_overflow
        self.digest_algorithm = digest_algorithm
        self.capabilities = capabilities
        self.casts = casts
        """What `hash_tensors` casts by, for a mode that casts or not."""
        self.cast = cast
        self.expert_layout = expert_layout
        self._metas: tuple[WeightSource, list[TensorMeta]] | None = None
        """The source `metas` read this push, and what it read."""

    def share_step(self, step: Mapping[str, Any]) -> None:
        self.ranks.share({"step": dict(step)}, timeout_s=self.timeout_s)

    def metas(self, source: WeightSource) -> list[TensorMeta]:
        if self._metas is None or self._metas[0] is not source:
            self._metas = (source, list(source.metas()))
        return self._metas[1]

    def hash_tensors(self, source: WeightSource, *, cast: bool) -> dict[str, str]:
        """Digest of every tensor of `source` as the engines would hold it (cast where floating,
        with `cast`); every trainer rank gathers along."""
        t0 = time.perf_counter()
        sent = self.casts.of(cast=cast)
        names = [m.hf_name for m in source.metas()]
        self.ranks.share({"mode": source.mode, "order": names, "expert_layout": self.expert_layout},
                         timeout_s=self.timeout_s)
        digests = {name: _digest_as_sent(name, t, sent) for name, t in source.tensors(names)}
        self.stages.hash += time.perf_counter() - t0
        return digests

    def served_digests(self, hf_names: Sequence[str]) -> list[dict[str, str]]:
        timeout_s = self.timeout_s
        return self._replicas.ask_digest_readers(lambda e: e.digests(hf_names, timeout_s=timeout_s), "reading digests")

    def served_instances(self) -> list[str | None]:
        timeout_s = self.timeout_s
        return self._replicas.ask_digest_readers(lambda e: e.instance(timeout_s=timeout_s), "asking its instance")

    def unloaders(self) -> Sequence[AdapterUnloader]:
        self._replicas.handshake()  # at close, the session may have been left since the last push: ask again
        return self._replicas.unloaders()


@dataclass
class PushPlan:
    """One phase of a push, planned: what the mode selected, as the engines will receive it."""

    selection: Selection
    buckets: BucketPlan
    cast: Cast
    """The dtype each floating tensor travels in."""
    manifest: Manifest
    """Without digests (they are known once the buckets are packed)."""
