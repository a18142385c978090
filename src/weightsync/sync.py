"""The coordinator: `WeightSync.push(model, version)` leaves every engine
serving `version`, verified, or raises and leaves them on their last good one.

One push, on the sending rank:

    plan      metas -> buckets (delta: only tensors whose digest changed)
    session   transport.open + engine.connect (once; reused across pushes)
    begin     every engine checks the manifest (names, shapes, dtypes)
    stream    producer thread: gather -> pack into a slot (k%2, or a leased one) -> hash
              main thread:     deliver bucket k to every engine (wire)
              at most two buckets alive; bucket k+2 waits for bucket k
    commit    pause (per policy) -> every engine applies and acks -> resume
    verify    acks: version, every bucket digest, every name

Any failure after begin aborts the update on every engine (they keep serving
their previous version), discards the transport's leftovers, tears down a
broadcast group, resumes generation, and raises. Engines that stage updates
(`stages_updates`) keep generating while bytes stream and pause only around
the commit; the others are paused from begin to commit.

Every round of engine calls made for a push (and the trainer's side of a
collective) is bounded by the push's `timeout_s`, whatever the engine client
was built with; the cleanup rounds after a failure (abort, rollback, leaving
the session, resume) share one bound, min(timeout_s, 10 s), and skip an engine
that timed out in this push: its cleanup runs in the background
(`weightsync.cleanup`), and the next push waits for it (at most timeout_s)
before it begins. So a push raises at most timeout_s + min(timeout_s, 10 s)
after the call that stalled began: from its start when an engine is stalled
from the start.
A push that paused, or tried to, resumes every engine, whatever failed.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from weightsync.bucketing import castable, plan_buckets, stream_order
from weightsync.change_encoding import ENCODINGS
from weightsync.cleanup import Backlog
from weightsync.digests import ALGORITHMS, XXH3_64, for_device
from weightsync.dtypes import dtype_from_name, dtype_name
from weightsync.engines.base import (
    CLEANUP_TIMEOUT_S,
    AdapterUnloader,
    DigestReader,
    Engine,
    EngineCapabilities,
    Link,
    PausePolicy,
    Rollbacker,
)
from weightsync.errors import (
    CastError,
    EngineError,
    IntegrityError,
    SyncTimeoutError,
    WeightSyncError,
)
from weightsync.hosts import is_local_host, is_loopback, local_address_towards, url_host
from weightsync.integrity import ack_problems, digest
from weightsync.manifest import MODES, BucketMeta, Manifest, TensorMeta
from weightsync.modes import ModeOptions, PushMode, Selection, make_mode, make_source
from weightsync.naming import ExpertLayout, has_fused_experts, rename
from weightsync.owners import session_owner
from weightsync.pipeline import Stages, stream_buckets
from weightsync.reports import Ack, SyncReport
from weightsync.sources import WeightSource
from weightsync.trainer_ranks import TrainerRanks
from weightsync.transports import TRANSPORTS, make_transport, transport_class
from weightsync.transports.base import Transport

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSPORT_OPTIONS = frozenset({"disk_root", "keep_versions", "master_address", "backend"})
"""`SyncConfig` fields that only configure a transport made by name."""

@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """How `WeightSync` moves weights."""

    transport: str = "http"
    """The transport's name, one of `weightsync.transports.TRANSPORTS` ("disk", "http",
    "broadcast", "shm"); with a transport object, its `name`."""
    mode: str = "full"
    """"full", "lora", "lora-merged", "delta" or "sparse"."""
    bucket_bytes: int = 256 << 20
    """Byte budget of one bucket (a larger tensor gets a bucket of its own)."""
    pause: PausePolicy = PausePolicy.RETRACT
    """What happens to in-flight requests while weights change."""
    timeout_s: float = 60.0
    """Limit for every network call and collective of a push, whatever the engine
    clients were built with."""
    lora_prefix: str = "policy"
    """"lora" mode: adapters load as `<lora_prefix>-v<version>`."""
    lora_keep: int = 2
    """"lora" mode: adapter versions kept loaded per engine, the current one included.
    The adapter of push N is unloaded (after the requests still using it finish)
    once push N + lora_keep has committed, so with 2 a name read from `lora_name`
    stays servable for at least one whole push after it stops being current."""
    adapter_name: str | None = None
    """The PEFT adapter to sync (default: the model's active one)."""
    sparse_snapshot: str = "trainer"
    """"sparse" mode: where its copy of the acked version lives (one model copy in the
    engines' dtype): "trainer" (each tensor's own device) or "host" (CPU memory)."""
    disk_root: str | None = None
    """"disk" transport: the directory engines read versions from."""
    keep_versions: int = 2
    """"disk" transport: versions kept on disk."""
    master_address: str = "127.0.0.1"
    """"broadcast" transport: address engines reach the trainer's store at."""
    backend: str | None = None
    """"broadcast" transport: "gloo" or "nccl" (default: by buffer device)."""
    rename: Mapping[str, str] | None = None
    """hf_name -> engine_name for engines whose names differ."""
    dtype: torch.dtype | str | None = None
    """The dtype floating tensors travel in. None: the dtype the engines serve (they must
    agree), e.g. float32 master weights go to a bfloat16 engine as bfloat16, cast bucket
    by bucket exactly as `tensor.to(dtype)`; "lora" adapters then go as the trainer holds
    them (engines cast adapters themselves). Integer and bool tensors are never cast."""
    allow_overflow: bool = False
    """Accept casts that turn finite values into infinities (e.g. to float16); by default
    such a push fails naming the tensor, and the engines keep their last version."""
    digest_algorithm: str | None = None
    """How bucket digests are computed, one of `weightsync.digests.ALGORITHMS`. None: by
    where the transport's buffers live: "wsmix64" on a device (CUDA buckets are hashed
    in place), "xxh3_64" on the CPU (faster there)."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; valid names: {', '.join(TRANSPORTS)}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; one of {MODES}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.lora_keep < 1:
            raise ValueError(f"lora_keep must be at least 1, got {self.lora_keep}")
        dtype = dtype_from_name(self.dtype) if isinstance(self.dtype, str) else self.dtype
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype (only floating tensors are cast), got {dtype}")
        object.__setattr__(self, "dtype", dtype)
        if self.digest_algorithm is not None and self.digest_algorithm not in ALGORITHMS:
            raise ValueError(f"unknown digest_algorithm {self.digest_algorithm!r}; one of {', '.join(ALGORITHMS)}")

    @property
    def cleanup_timeout_s(self) -> float:
        """Bound of the cleanup rounds after a failure together (abort, rollback, leaving the
        session, resume), and of each cleanup call that runs in the background."""
        return min(CLEANUP_TIMEOUT_S, self.timeout_s)


class WeightSync:
    """Pushes a trainer's weights into inference engines, verified.

    With `process_group` (the trainer's group, e.g. FSDP2's), every rank calls
    `push` with its shard of the model; rank `send_rank` talks to the engines
    and every rank returns the same report.

    `transport` is a name (the sending rank makes it at construction from
    `timeout_s` and the transport options: `disk_root`, `keep_versions`,
    `master_address`, `backend`) or a `Transport` object built by the caller,
    e.g. `DiskTransport(root)`, used as it is (its own `timeout_s` bounds its links and,
    for a broadcast, the trainer's side of every collective: build it with the push's);
    `config.transport` holds its name.
    """

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        transport: str | Transport = "http",
        mode: str = "full",
        bucket_bytes: int = 256 << 20,
        pause: str | PausePolicy = PausePolicy.RETRACT,
        timeout_s: float = 60.0,
        process_group: dist.ProcessGroup | None = None,
        send_rank: int = 0,
        **options: Any,
    ) -> None:
        given: Transport | None = None
        if not isinstance(transport, str):
            if not isinstance(transport, Transport):
                raise TypeError(f"transport must be a name ({', '.join(TRANSPORTS)}) or a Transport, "
                                f"got {type(transport).__name__}")
            clashing = sorted(TRANSPORT_OPTIONS & options.keys())
            if clashing:
                raise ValueError(f"{', '.join(clashing)} configure a transport made by name; with a "
                                 f"{type(transport).__name__} object, set them when you build it")
            given, transport = transport, transport.name
        self.config = SyncConfig(transport=transport, mode=mode, bucket_bytes=bucket_bytes,
                                 pause=PausePolicy.parse(pause), timeout_s=timeout_s, **options)
        self.engines = list(engines)
        self.ranks = TrainerRanks(process_group, send_rank=send_rank)
        self._transport: Transport | None = given
        """The sending rank's transport (given, or made by name); the other ranks have none."""
        if self.config.mode == "sparse" and self.ranks.is_distributed and self.config.digest_algorithm == XXH3_64:
            raise ValueError("mode='sparse' with a process_group digests each whole tensor from its ranks' parts, "
                             "which only wsmix64 can: leave digest_algorithm unset or pass 'wsmix64'")
        self._mode = make_mode(self.config.mode, ModeOptions(
            adapter_name=self.config.adapter_name, lora_prefix=self.config.lora_prefix,
            lora_keep=self.config.lora_keep, sparse_snapshot=self.config.sparse_snapshot))
        """What pushes send, and what that mode remembers between pushes."""
        if self.ranks.is_sender:
            self._check_engines()
            self._make_transport()  # now: a missing transport option fails here, not at the first push
            self._check_hosts()
        self._links: list[Link] | None = None
        # per engine: a call of the push and a background cleanup task (which waits for that call)
        self._pool = ThreadPoolExecutor(max_workers=2 * len(self.engines) + 2, thread_name_prefix="weightsync")
        self._backlog = Backlog(self._pool, settle_s=self.config.cleanup_timeout_s)
        """Engines that timed out in this push and the cleanup they are owed (`weightsync.cleanup`)."""
        self._cleanup_by: float | None = None
        """While a failed push cleans up: when every cleanup round must have answered."""
        self._caps: list[EngineCapabilities] | None = None
        """What each engine can do; asked once per transport session."""
        self._expert_layout: ExpertLayout = "per-expert"
        """The expert layout of the push under way (`_layout`), which other trainer ranks read in too."""
        self.owner = session_owner()
        """This trainer's identity on the engines: its sessions are never taken by another
        live trainer, and it takes over those of a dead one (see `weightsync.sessions`)."""
        self._closed = False
        self._last_plan: tuple[_PlanKey, dict[str, str], tuple[BucketMeta, ...], list[str]] | None = None
        """The last push's plan (key, hf -> engine names, buckets, stream order): reused while
        a push selects the same tensors (names, dtypes, shapes, encodings), as an RL loop's
        full pushes do step after step. Never shared by callers: plans are immutable."""

    # -- public ------------------------------------------------------------

    @property
    def lora_name(self) -> str | None:
        """The adapter name requests should use now ("lora" mode); it stays servable
        until push N + lora_keep commits (see `SyncConfig.lora_keep`)."""
        return self._mode.lora_name

    def push(self, model: nn.Module | WeightSource, version: int) -> SyncReport:
        """Make every engine serve `model`'s weights as `version`."""
        if self._closed:
            raise WeightSyncError("this WeightSync is closed")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version must be a non-negative integer, got {version!r}")
        if not self.ranks.is_sender:
            return self._follow(model)
        try:
            self._backlog.wait(self.config.timeout_s, f"the push of v{version}")
            report = self._push(self._mode, model, version)
        except BaseException as e:
            self._mode.failed(version)
            owed = self._backlog.owed_labels()
            if owed:
                e.add_note(f"{', '.join(owed)} did not answer within timeout_s: the rest of the cleanup (abort, "
                           "leaving the session, resume) goes out in the background; the next push waits for it")
            if isinstance(e, WeightSyncError):
                self._tell_followers({"error": f"{type(e).__name__}: {e}"})
            raise
        finally:
            self._backlog.start()
        self._tell_followers({"report": report.to_dict()})
        return report

    def close(self) -> None:
        """Tear down the transport session and leave every engine's group."""
        if self._closed:
            return
        self._closed = True
        try:
            self._backlog.wait(self.config.timeout_s, "closing")
        except SyncTimeoutError as e:
            log.warning("%s", e)
        self._mode.close(_Planner(self, Stages()))
        self._end_session()
        self._backlog.start()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one push ----------------------------------------------------------

    def _push(self, mode: PushMode, model: Any, version: int) -> SyncReport:
        """plan -> begin -> stream -> commit -> verify, asking `mode` what to send."""
        started = time.perf_counter()
        stages = Stages()
        planner = _Planner(self, stages)
        self._expert_layout = self._layout(self._capabilities(), model)
        source = mode.source(model, expert_layout=self._expert_layout)
        mode.prepare(model, version, planner)
        held = {m.hf_name: m.dtype for m in planner.metas(source)}  # as the trainer holds them (sparse: metas are cast)
        while True:
            plan = self._plan(mode, source, version, planner, held)
            try:
                manifest, acks, begin_notes = self._transfer(mode, plan, source, stages)
            except _Refused:
                continue  # the mode chose again (delta: the whole model)
            break
        verified, notes = self._verify(acks)
        notes = begin_notes + notes
        metas = plan.selection.metas
        entries = list(manifest.entries())
        encodings = Counter(e.encoding for e in entries)
        sent = [held.get(m.hf_name, m.dtype) for m in metas]
        cast = sorted({dtype_name(d) for d in sent if _sent_dtype(d, plan.cast_to) != d})
        if plan.cast_to is not None and cast:
            notes.append(f"floating tensors cast from {', '.join(cast)} to {dtype_name(plan.cast_to)} in the stream")
        mode.committed(plan.selection, version, planner)
        return SyncReport(
            version=version, mode=manifest.mode, transport=self.config.transport, num_bytes=manifest.num_bytes,
            num_tensors=len(metas), num_buckets=len(manifest.buckets), seconds=time.perf_counter() - started,
            stages=stages.frozen(), verified=verified, acks=tuple(acks),
            num_skipped=plan.selection.num_skipped, notes=tuple(notes),
            num_elements=sum(e.numel if e.is_dense else e.num_changed for e in entries),
            encodings={k: encodings[k] for k in ENCODINGS if k in encodings},
        )

    def _plan(self, mode: PushMode, source: WeightSource, version: int, planner: _Planner,
              held: Mapping[str, torch.dtype]) -> _PushPlan:
        """What the mode selects, renamed, cast and cut into buckets; checked before a byte moves.
        `held`: every tensor of `source` -> its dtype."""
        cast_to = self._cast_dtype(self._capabilities(), cast=mode.casts)
        selection = mode.select(source, version, planner)
        in_one_bucket = selection.lora_config is not None and self._make_transport().adapter_in_one_bucket
        key = _PlanKey(hf_names=list(held), metas=list(selection.metas), cast_to=cast_to, in_one_bucket=in_one_bucket)
        if self._last_plan is not None and self._last_plan[0] == key:
            _, to_engine, buckets, order = self._last_plan  # the same tensors as the last push: its plan
        else:
            # renamed for the whole source, so a rename entry of a tensor left out is not stale
            to_engine = rename(held, self.config.rename or {})
            engine_metas = [replace(m, hf_name=to_engine[m.hf_name], dtype=_sent_dtype(m.dtype, cast_to))
                            for m in selection.metas]
            bucket_bytes = self.config.bucket_bytes
            if in_one_bucket:
                bucket_bytes = max(1, sum(m.nbytes for m in engine_metas))
            buckets = plan_buckets(engine_metas, bucket_bytes)
            to_hf = {v: k for k, v in to_engine.items()}
            order = [to_hf[n] for n in stream_order(buckets)]
            self._last_plan = (key, to_engine, buckets, order)
        manifest = Manifest(
            version=version, mode=selection.mode, buckets=buckets,
            lora_config=selection.lora_config, lora_name=selection.lora_name,
            base_version=selection.base_version, owner=self.owner, timeout_s=self.config.timeout_s,
            digest_algorithm=selection.digest_algorithm or self._digest_algorithm(),
        )
        return _PushPlan(selection=selection, manifest=manifest, cast_to=cast_to, to_engine=to_engine,
                         order=order)

    def _transfer(self, mode: PushMode, plan: _PushPlan, source: WeightSource,
                  stages: Stages) -> tuple[Manifest, list[Ack], list[str]]:
        """begin, stream, commit on every engine: (the manifest with its digests, acks, notes
        of begin). On any failure every engine is left on its last version; raises
        `_Refused` (nothing moved) when an engine refused at begin and the mode plans again."""
        manifest, version = plan.manifest, plan.manifest.version
        adopting = all(c.adopts_shm for c in self._capabilities())
        self._ensure_session(max((b.nbytes for b in manifest.buckets), default=1),
                             leased_buckets=len(manifest.buckets) if adopting else 0)
        paused = False
        stage_all = all(c.stages_updates for c in self._capabilities())
        begun = committing = failed = False
        try:
            if not stage_all:
                paused = True  # before asking: a pause that timed out may land when the engine wakes
                self._pause()
            try:
                begin_notes = self._begin(manifest)
            except EngineError as e:
                if mode.refused(plan.selection, e):
                    raise _Refused from e
                raise
            except SyncTimeoutError:
                begun = True  # the engine may still open the update when it answers: abort it
                raise
            begun = True
            assert self._transport is not None
            self._transport.begin(manifest)
            step = plan.selection.follower_step
            self._share_with_followers(mode=source.mode, order=plan.order, expert_layout=self._expert_layout,
                                       **({"step": step} if step else {}))
            digests = stream_buckets(
                plan.selection.stream or source, manifest.buckets, plan.order, plan.to_engine,
                slot=self._transport.slot,
                deliver=self._deliver, stages=stages, allow_overflow=self.config.allow_overflow,
                drain=self.ranks.is_distributed,  # the other ranks must finish their gathers
                digest_algorithm=manifest.digest_algorithm)
            manifest = manifest.with_digests(digests)
            self._transport.finish(manifest)
            if not paused:
                paused = True
                self._pause()
            if len(self.engines) > 1:  # find an engine that cannot commit before any does
                self._all(lambda e, link: e.ready(manifest, link), "checking it can commit")
            t0 = time.perf_counter()
            committing = True
            acks = self._commit_round(manifest)
            stages.load = time.perf_counter() - t0
            self._transport.committed(acks)
            begun = False
        except _Refused:
            raise
        except BaseException as e:
            failed = True
            self._fail(version, begun, e, committing=committing)
            raise
        finally:
            if paused:
                self._resume(self.config.cleanup_timeout_s if failed else self.config.timeout_s)
            self._cleanup_by = None
        return manifest, acks, begin_notes

    def _deliver(self, bucket: BucketMeta, buffer: torch.Tensor) -> None:
        """Hand one packed bucket to the transport and every engine (per-bucket transports)."""
        transport = self._transport
        assert transport is not None
        delivery = transport.deliver(bucket, buffer)
        if not transport.per_bucket_delivery:
            return
        deadline = time.monotonic() + self.config.timeout_s  # the collective is bounded by timeout_s too
        futures = [self._pool.submit(e.receive, bucket, delivery) for e in self.engines]
        try:
            transport.send(bucket, buffer)
        except SyncTimeoutError:  # the engines that have not answered did not take the bucket in time either
            for i, future in enumerate(futures):
                if not future.done():
                    self._backlog.mark(i, self.engines[i].label, future)
            raise
        for i, future in enumerate(futures):
            self._wait(future, f"{self.engines[i].label}: receiving bucket {bucket.index}", index=i,
                       deadline=deadline)

    # -- session, pause, commit helpers ------------------------------------

    def _begin(self, manifest: Manifest) -> list[str]:
        """Every engine's dry run. An engine busy with another live trainer's session says
        when that session would expire: ask again until it ends or expires, within
        timeout_s. Returns notes for the report (a dead trainer's session discarded)."""
        started = time.monotonic()
        deadline = started + self.config.timeout_s
        backoff, busy = 0.05, 0
        while True:
            try:
                # each attempt has timeout_s of its own: an engine that answers 409 is alive
                answers = self._all(lambda e, link: e.begin(manifest, link), "begin")
            except EngineError as e:
                expires = e.retry_after_s
                if e.status != 409 or expires is None or time.monotonic() + expires > deadline:
                    raise
                log.info("%s", e)
                busy += 1
                # ask again soon (the other push may just finish) and at the latest when it expires
                time.sleep(min(backoff, expires + 0.05))
                backoff = min(2 * backoff, 1.0)
                continue
            notes = [f"{e.label}: {a}" for e, a in zip(self.engines, answers, strict=True) if a]
            if busy:
                notes.append(f"waited {time.monotonic() - started:.1f}s ({busy} busy answer(s)) for another "
                             "trainer's update session to end or expire")
            return notes

    def _capabilities(self) -> list[EngineCapabilities]:
        """Every engine's declared capabilities, asked once per transport session."""
        if self._caps is None:
            timeout_s = self.config.timeout_s
            caps = self._all(lambda e, _: e.capabilities(timeout_s), "asking its capabilities")
            for engine, c in zip(self.engines, caps, strict=True):
                declared = c.lora_transports if self._mode.sends_adapter else c.transports
                if declared and self.config.transport not in declared:
                    raise EngineError(engine.label, f"this engine takes mode={self.config.mode!r} over "
                                      f"{sorted(declared)}, not transport={self.config.transport!r}")
            self._caps = caps
        return self._caps

    def _cast_dtype(self, caps: Sequence[EngineCapabilities], *, cast: bool) -> torch.dtype | None:
        """The dtype floating tensors travel in (see `SyncConfig.dtype`); checked before any byte moves."""
        forced = self.config.dtype
        if forced is not None:
            assert isinstance(forced, torch.dtype)
            return forced
        if not cast:
            return None
        served = {e.label: c.dtype for e, c in zip(self.engines, caps, strict=True) if c.dtype is not None}
        if len(set(served.values())) > 1:
            listed = ", ".join(f"{label} serves {dtype_name(d)}" for label, d in served.items())
            raise CastError(f"engine replicas serve different dtypes ({listed}); start them with one dtype, "
                            "or pass dtype= to send one (an engine that cannot take it refuses at begin)")
        return next(iter(served.values()), None)

    def _layout(self, caps: Sequence[EngineCapabilities], model: Any) -> ExpertLayout:
        """The expert layout the engines load (`EngineCapabilities.expert_layout`); replicas must
        agree where the model holds fused experts (elsewhere the layout names nothing)."""
        layouts = {e.label: c.expert_layout for e, c in zip(self.engines, caps, strict=True)}
        if len(set(layouts.values())) > 1 and isinstance(model, nn.Module) and has_fused_experts(model):
            listed = ", ".join(f"{label} loads {layout}" for label, layout in layouts.items())
            raise ValueError(f"engine replicas load Mixture-of-Experts layers in different layouts ({listed}); "
                             "push to each kind with its own WeightSync")
        return next(iter(layouts.values()), "per-expert")

    def _digest_algorithm(self) -> str:
        """The algorithm of this session's digests (see `SyncConfig.digest_algorithm`)."""
        return self.config.digest_algorithm or for_device(self._make_transport().buffer_device)

    def _unloaders(self) -> list[AdapterUnloader]:
        return [e for e, c in zip(self.engines, self._capabilities(), strict=True)
                if c.unloads_adapters and isinstance(e, AdapterUnloader)]

    def _make_transport(self) -> Transport:
        """The trainer side of the transport, made on first use and kept."""
        if self._transport is None:
            self._transport = make_transport(
                self.config.transport, timeout_s=self.config.timeout_s, disk_root=self.config.disk_root,
                keep_versions=self.config.keep_versions, master_address=self.config.master_address,
                backend=self.config.backend,
            )
        return self._transport

    def _ensure_session(self, max_bucket_bytes: int, *, leased_buckets: int = 0) -> list[Link]:
        transport = self._make_transport()
        links = transport.open([c.num_ranks for c in self._capabilities()], max_bucket_bytes=max_bucket_bytes,
                               leased_buckets=leased_buckets)
        if self._links is not None and links == self._links:
            return self._links  # the same session: engines stay connected
        if self._links is not None:
            self._disconnect(self._links)  # e.g. a new group or a bigger segment replaces the old
        self._links = None
        connects = [self._pool.submit(e.connect, link) for e, link in zip(self.engines, links, strict=True)]
        deadline = time.monotonic() + self.config.timeout_s  # forming a group included
        try:
            transport.establish()
            for i, future in enumerate(connects):
                self._wait(future, f"{self.engines[i].label}: joining the {self.config.transport} session",
                           index=i, deadline=deadline)
        except BaseException:
            for i, future in enumerate(connects):
                if not future.done():  # it leaves once its join has answered
                    self._backlog.mark(i, self.engines[i].label, future)
            self._end_session(links)
            raise
        self._links = links
        return links

    def _end_session(self, links: Sequence[Link] | None = None) -> None:
        links = links if links is not None else self._links
        if self._transport is not None:
            self._transport.close()
        if links is not None:
            self._disconnect(links)
        self._links = None
        self._caps = None  # a new session asks again (an engine may have been restarted)

    def _disconnect(self, links: Sequence[Link]) -> None:
        """Every engine leaves the session at once; the links carry the cleanup bound."""
        def leave(engine: Engine, link: Link) -> None:
            engine.disconnect(replace(link, timeout_s=self.config.cleanup_timeout_s))

        self._cleanup(lambda e, i: leave(e, links[i]), "leaving the session")

    def _pause(self) -> None:
        """Pause every engine per the policy. The caller resumes every engine even when this
        raises: a pause that failed may have taken effect on some engine, or still take effect
        (vLLM 0.32 applies a `/pause` it read after the client gave up on the answer), and
        an engine left paused would hold every request forever."""
        if self.config.pause is not PausePolicy.NONE:
            timeout_s = self.config.timeout_s
            self._all(lambda e, _: e.pause(self.config.pause, timeout_s=timeout_s), "pause")

    def _resume(self, timeout_s: float) -> None:
        if self.config.pause is not PausePolicy.NONE:
            self._cleanup(lambda e, _: e.resume(timeout_s=timeout_s), "resuming generation", timeout_s=timeout_s)

    def _commit_round(self, manifest: Manifest) -> list[Ack]:
        """Commit on every engine and check every ack against what was sent. Engines that
        can undo a commit (`EngineCapabilities.rolls_back`) commit first, all at once; the
        others only once every one of those acked what was sent. On a failure the caller
        rolls back the engines that committed, so a push is all or nothing across replicas
        when at most one engine cannot undo its commit."""
        undoable = [r is not None for r in self._rollbackers()]
        acks: dict[int, Ack] = {}
        for first in (True, False):
            among = [i for i, u in enumerate(undoable) if u is first]
            if not among:
                continue
            # every answer is awaited: a rollback must not overtake a commit still under way
            acks.update(zip(among, self._all(lambda e, link: e.commit(manifest, link), "commit",
                                             among=among, settle=True), strict=True))
            problems = [p for i in among for p in _ack_problems(manifest, acks[i])]
            if problems:
                raise IntegrityError("engines acked something other than what was sent: " + "; ".join(problems))
        return [acks[i] for i in range(len(self.engines))]

    def _roll_back(self, version: int, error: BaseException) -> None:
        """After a failed commit round: undo `version` on every engine that committed it and
        can (a no-op where it did not commit); says what it did in a note on `error`. An
        engine that timed out in this push is rolled back in the background."""
        cleanup_s = self.config.cleanup_timeout_s
        deadline = self._cleanup_deadline(cleanup_s)
        futures = []
        for i, engine in enumerate(self._rollbackers()):
            if engine is None:
                continue
            future = self._cleanup_call(i, f"rollback of v{version}",
                                        functools.partial(engine.rollback, version, timeout_s=cleanup_s))
            if future is None:
                error.add_note(f"{engine.label} did not answer: its rollback of v{version} goes out in the "
                               f"background (if its commit landed, it serves v{version} until then)")
            else:
                futures.append((i, engine, future))
        undone = []
        for i, engine, future in futures:
            try:
                if self._wait(future, f"{engine.label}: rollback of v{version}", index=i, deadline=deadline,
                              limit_s=cleanup_s):
                    undone.append(engine.label)
            except WeightSyncError as e:
                log.warning("%s", e)
                error.add_note(f"{engine.label} was not rolled back (if its commit landed, it serves v{version}): {e}")
        if undone:
            log.warning("v%d rolled back on %s", version, ", ".join(undone))
            error.add_note(f"v{version} had committed on {', '.join(undone)}: rolled back to the last version")

    def _rollbackers(self) -> list[Rollbacker | None]:
        """Per engine: itself where it can undo its last commit (`EngineCapabilities.rolls_back`), else None."""
        return [e if c.rolls_back and isinstance(e, Rollbacker) else None
                for e, c in zip(self.engines, self._capabilities(), strict=True)]

    def _fail(self, version: int, begun: bool, error: BaseException, *, committing: bool = False) -> None:
        """Leave every engine on its last good version after `error`; `committing`: it came in
        the commit round, so some engines may have committed."""
        log.warning("push of v%d failed: %s", version, error)
        self._cleanup_by = time.monotonic() + self.config.cleanup_timeout_s  # every round below shares it
        if begun:
            cleanup_s = self.config.cleanup_timeout_s
            self._cleanup(lambda e, _: e.abort(version, timeout_s=cleanup_s), f"abort of v{version}")
        if committing:
            self._roll_back(version, error)
        if self._transport is not None:
            self._transport.discard(version)
        if not self._make_transport().survives_failure or isinstance(error, SyncTimeoutError):
            self._end_session()

    def _all(self, call: Callable[[Any, Link | None], T], what: str, *, among: Sequence[int] | None = None,
             settle: bool = False, deadline: float | None = None) -> list[T]:
        """`call(engine, link)` on every engine (those at the indices `among`) at once, all
        answered by `deadline` (default: timeout_s from now); the first error wins, raised
        at once or, with `settle`, once every call answered or timed out."""
        deadline = time.monotonic() + self.config.timeout_s if deadline is None else deadline
        links: Sequence[Link | None] = self._links or [None] * len(self.engines)
        chosen = range(len(self.engines)) if among is None else among
        futures = [(i, self._pool.submit(call, self.engines[i], links[i])) for i in chosen]
        results: list[T] = []
        first: BaseException | None = None
        for i, future in futures:
            try:
                results.append(self._wait(future, f"{self.engines[i].label}: {what}", index=i, deadline=deadline))
            except BaseException as e:
                if not settle:
                    raise
                first = first or e
        if first is not None:
            raise first
        return results

    def _cleanup(self, call: Callable[[Any, int], object], what: str, *, timeout_s: float | None = None) -> None:
        """`call(engine, index)` on every engine at once, answered within `timeout_s` (the
        cleanup bound by default; while a failed push cleans up, what is left of its shared
        bound); errors are logged, never raised. An engine that timed out in this push is not
        waited on: the call joins its backlog (`weightsync.cleanup`), as does every later one."""
        limit_s = self.config.cleanup_timeout_s if timeout_s is None else timeout_s
        deadline = self._cleanup_deadline(limit_s)
        futures = [(i, self._cleanup_call(i, what, functools.partial(call, engine, i)))
                   for i, engine in enumerate(self.engines)]
        for i, future in futures:
            if future is None:
                continue
            try:
                self._wait(future, f"{self.engines[i].label}: {what}", index=i, deadline=deadline, limit_s=limit_s)
            except WeightSyncError as e:
                log.warning("%s", e)

    def _cleanup_call(self, index: int, what: str, call: Callable[[], object]) -> Future[Any] | None:
        """Start a cleanup call to engine `index` now, or, where it timed out in this push,
        add it to its backlog (None): it is not waited on twice."""
        if self._backlog.stalled(index):
            self._backlog.owe(index, what, call)
            return None
        return self._pool.submit(call)

    def _cleanup_deadline(self, limit_s: float) -> float:
        """When a cleanup round must have answered: the shared bound of a failed push's
        cleanup while it runs, else `limit_s` from now."""
        return self._cleanup_by if self._cleanup_by is not None else time.monotonic() + limit_s

    def _wait(self, future: Future[T], what: str, *, index: int, deadline: float, limit_s: float | None = None) -> T:
        """The answer of engine `index`'s call `future` by `deadline` (whichever fires first:
        this or the engine client's own timeout). A call that times out marks the engine as
        stalled for the rest of the push; `limit_s` is the bound the error names."""
        limit_s = self.config.timeout_s if limit_s is None else limit_s
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self._backlog.mark(index, self.engines[index].label, future)
            raise SyncTimeoutError(f"{what}: no answer within {limit_s:.0f}s") from None
        except SyncTimeoutError:
            self._backlog.mark(index, self.engines[index].label)
            raise

    def _verify(self, acks: Sequence[Ack]) -> tuple[bool, list[str]]:
        """Whether every ack was digest-checked (in the commit round), and notes on those that were not."""
        unchecked = [a.engine for a in acks if _unverified(a)]
        notes = [f"{e}: the engine reports no digests (stock SGLang); update not digest-verified" for e in unchecked]
        return not unchecked, notes

    # -- what modes ask ------------------------------------------------------

    def _hash_tensors(self, source: WeightSource, cast_to: torch.dtype | None) -> dict[str, str]:
        """Digest of every tensor of `source` as the engines would hold it (cast to
        `cast_to` where floating); every trainer rank gathers along."""
        names = [m.hf_name for m in source.metas()]
        self._share_with_followers(mode=source.mode, order=names, expert_layout=self._expert_layout)
        return {name: digest(t.to(_sent_dtype(t.dtype, cast_to)).contiguous()) for name, t in source.tensors(names)}

    def _served_digests(self, hf_names: Sequence[str]) -> list[dict[str, str]]:
        timeout_s = self.config.timeout_s
        return self._ask_digest_readers(lambda e: e.digests(hf_names, timeout_s=timeout_s), "reading digests")

    def _served_instances(self) -> list[str | None]:
        timeout_s = self.config.timeout_s
        return self._ask_digest_readers(lambda e: e.instance(timeout_s=timeout_s), "asking its instance")

    def _ask_digest_readers(self, call: Callable[[DigestReader], T], what: str) -> list[T]:
        """`call` on every engine that reports digests of its served weights (`DigestReader`), at once."""
        readers = [(i, e) for i, (e, c) in enumerate(zip(self.engines, self._capabilities(), strict=True))
                   if c.reads_digests and isinstance(e, DigestReader)]
        deadline = time.monotonic() + self.config.timeout_s
        futures = [(i, e, self._pool.submit(call, e)) for i, e in readers]
        return [self._wait(f, f"{e.label}: {what}", index=i, deadline=deadline) for i, e, f in futures]

    # -- the other trainer ranks -------------------------------------------

    def _share_with_followers(self, **message: Any) -> None:
        if self.ranks.is_distributed:
            self.ranks.share(message, timeout_s=self.config.timeout_s)

    def _tell_followers(self, message: dict[str, Any]) -> None:
        if self.ranks.is_distributed:
            self.ranks.share(message, timeout_s=self.config.timeout_s)

    def _follow(self, model: nn.Module | WeightSource) -> SyncReport:
        """A non-sending rank: gather what the sender gathers, return its outcome.

        The sender says what to gather next ({"mode", "order"}) until it says
        how the push ended ({"report"} or {"error"}).
        """
        while True:
            message = self.ranks.share(None, timeout_s=self.config.timeout_s * 4)
            if "error" in message:
                raise WeightSyncError(f"the sending trainer rank failed: {message['error']}")
            if "report" in message:
                return SyncReport.from_dict(message["report"])
            if "step" in message:
                self._mode.follow(model, message["step"], message.get("order"), self.ranks,
                                  timeout_s=self.config.timeout_s)
                continue
            source = make_source(model, message["mode"], adapter_name=self.config.adapter_name,
                                 expert_layout=message.get("expert_layout", "per-expert"))
            for _ in source.tensors(message["order"]):
                pass

    def _check_engines(self) -> None:
        if not self.engines:
            raise ValueError("WeightSync needs at least one engine")
        for e in self.engines:
            allowed = e.lora_transports if self._mode.sends_adapter else e.transports
            if self.config.transport not in allowed:
                note = getattr(e, "transports_note", None)
                raise ValueError(
                    f"{e.label} cannot take mode={self.config.mode!r} over transport={self.config.transport!r}; "
                    f"it supports {sorted(allowed)}" + (f": {note}" if note else "")
                )
        if self.config.disk_root is not None:
            Path(self.config.disk_root).mkdir(parents=True, exist_ok=True)

    def _check_hosts(self) -> None:
        """Engines whose URL is not an address of this host cannot take a transport that
        works on one host only (shm), nor reach a broadcast group hosted on loopback:
        refused here, naming what works. An engine whose host does not resolve is left to
        fail when contacted."""
        transport = self._make_transport()
        same_host_only = getattr(transport, "same_host_only", False)
        master = getattr(transport, "master_address", None)
        on_loopback = isinstance(master, str) and is_loopback(master)
        if not (same_host_only or on_loopback):
            return
        for e in self.engines:
            url = getattr(e, "url", None)
            host = url_host(url) if isinstance(url, str) else None
            try:
                if host is None or is_local_host(host):
                    continue
            except ValueError:
                continue
            if same_host_only:
                allowed = e.lora_transports if self._mode.sends_adapter else e.transports
                works = [t for t in sorted(allowed) if not getattr(transport_class(t), "same_host_only", False)]
                raise ValueError(
                    f"{e.label} is on another host ({host} is not an address of this host), and "
                    f"transport={self.config.transport!r} reaches engines on the trainer's host only; use one "
                    f"of {', '.join(works)} (disk: a directory both hosts see; broadcast: master_address= an "
                    "address of this host the engine reaches)")
            try:
                towards = f"master_address={local_address_towards(host)!r} (this host's address on the route to {host})"
            except ValueError:
                towards = "master_address= an address of this host"  # no route from here: name none
            raise ValueError(f"{e.label} is on another host and cannot reach master_address={master!r}, this "
                             f"host's loopback: pass {towards} or another address of this host the engine reaches")

class _Refused(Exception):
    """An engine refused the manifest at begin and the mode chose to plan again."""


@dataclass(frozen=True)
class _PlanKey:
    """What a bucket plan depends on besides the config: equal keys, equal plans."""

    hf_names: list[str]
    """Every tensor of the source (the rename covers them all)."""
    metas: list[TensorMeta]
    """The tensors selected, as the trainer holds them."""
    cast_to: torch.dtype | None
    in_one_bucket: bool


@dataclass
class _PushPlan:
    """One push, planned: what the mode selected, as the engines will receive it."""

    selection: Selection
    manifest: Manifest
    """Without digests (they are known once the buckets are packed)."""
    cast_to: torch.dtype | None
    """The dtype floating tensors travel in (None: as the trainer holds them)."""
    to_engine: dict[str, str]
    """hf_name -> engine name, for the whole source."""
    order: list[str]
    """hf_names in stream order."""


class _Planner:
    """What a mode may ask of one `WeightSync` (`modes.base.Planner`), for one push."""

    def __init__(self, sync: WeightSync, stages: Stages) -> None:
        self._sync = sync
        self.stages = stages
        self.pool: Executor = sync._pool
        self.timeout_s = sync.config.timeout_s
        self.allow_overflow = sync.config.allow_overflow
        self.ranks = sync.ranks
        self._metas: tuple[WeightSource, list[TensorMeta]] | None = None
        """The source `metas` read this push, and what it read."""

    def share_step(self, step: Mapping[str, Any]) -> None:
        self._sync._share_with_followers(step=dict(step))

    def metas(self, source: WeightSource) -> list[TensorMeta]:
        if self._metas is None or self._metas[0] is not source:
            self._metas = (source, list(source.metas()))
        return self._metas[1]

    @property
    def digest_algorithm(self) -> str:
        return self._sync._digest_algorithm()

    def cast_dtype(self, *, cast: bool) -> torch.dtype | None:
        return self._sync._cast_dtype(self._sync._capabilities(), cast=cast)

    def capabilities(self) -> Sequence[EngineCapabilities]:
        return self._sync._capabilities()

    def hash_tensors(self, source: WeightSource, *, cast: bool) -> dict[str, str]:
        t0 = time.perf_counter()
        cast_to = self._sync._cast_dtype(self._sync._capabilities(), cast=cast)
        digests = self._sync._hash_tensors(source, cast_to)
        self.stages.hash += time.perf_counter() - t0
        return digests

    def served_digests(self, hf_names: Sequence[str]) -> list[dict[str, str]]:
        return self._sync._served_digests(hf_names)

    def served_instances(self) -> list[str | None]:
        return self._sync._served_instances()

    def push(self, mode: PushMode, model: Any, version: int) -> SyncReport:
        return self._sync._push(mode, model, version)

    def unloaders(self) -> Sequence[AdapterUnloader]:
        return self._sync._unloaders()


def _sent_dtype(dtype: torch.dtype, cast_to: torch.dtype | None) -> torch.dtype:
    """What a tensor of `dtype` travels as: `cast_to` if both are floating (bucketing.castable)."""
    return cast_to if cast_to is not None and castable(dtype, cast_to) else dtype


def _unverified(ack: Ack) -> bool:
    """A stock SGLang's ack: it reports no digests, so nothing in it can be checked."""
    return bool(ack.digests) and all(d is None for d in ack.digests)


def _ack_problems(manifest: Manifest, ack: Ack) -> list[str]:
    """How `ack` differs from what was sent (`integrity.ack_problems`); none for an unverified ack."""
    return [] if _unverified(ack) else ack_problems(manifest, ack)
