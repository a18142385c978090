"""The coordinator: `WeightSync.push(model, version)` leaves every engine serving `version`,
verified, or raises and leaves them on their last good one.

A push as the protocol reads: the handshake (`push.replicas`), the mode's phases and plan
(`push.planning`), begin, the stream (`push.pipeline`, fanned out by `push.fanout`), commit,
verify. Any failure after begin aborts the update on every engine, discards the transport's
leftovers and resumes generation before it raises. The walkthrough of a push is
docs/ARCHITECTURE.md's; what a push promises (its time bound, streamed commits) docs/GUARANTEES.md's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weightsync.change_encoding import ENCODINGS
from weightsync.digests import ALGORITHMS, COMBINABLE, for_device
from weightsync.dtypes import Cast, dtype_from_name
from weightsync.engines.base import CLEANUP_TIMEOUT_S, Engine, PausePolicy
from weightsync.errors import CastError, EngineError, SyncTimeoutError, WeightSyncError
from weightsync.integrity import digest_checked
from weightsync.manifest import COMMITS, MODES, BucketMeta, Manifest
from weightsync.modes import ModeOptions, PushMode, make_mode
from weightsync.naming import ExpertLayout
from weightsync.owners import session_owner
from weightsync.push.fanout import check_fan_out, make_fan_out
from weightsync.push.fanout.base import Streaming
from weightsync.push.followers import follow
from weightsync.push.planning import BucketPlanner, Casts, PushPlan, PushPlanner, cast_notes, expert_layout
from weightsync.push.quantize import quantized_source
from weightsync.push.rank_shares import ShareOrder, send_shares
from weightsync.push.replicas import Replicas
from weightsync.reports import Ack, Stages, SyncReport
from weightsync.sources import WeightSource
from weightsync.trainer_ranks import TrainerRanks
from weightsync.transports import TRANSPORTS, make_transport
from weightsync.transports.base import Transport

log = logging.getLogger(__name__)

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
    fan_out: str = "direct"
    """How a push reaches several engines: "direct", the trainer sends each engine every
    bucket; "relay", the trainer sends each bucket to the first engine, which checks it,
    stages it and forwards it to the next, and so on along the engines in order (a chain),
    so the trainer's link carries the model once. "relay" needs engines that declare `relays`
    (`weightsync serve`) and transport "http" (engines forward over HTTP) or "broadcast"
    (point-to-point sends in the group, gloo); disk and shm do not relay (docs/SCALE.md)."""
    send_shares: bool = False
    """With a `process_group` (FSDP2), every trainer rank sends its own rows of each bucket
    (`weightsync.push.rank_shares`): nothing is gathered to one rank, and each rank's link
    carries its share of the model; each engine assembles the bucket and checks its whole
    digest (wsmix64, combined from the ranks' parts). Needs mode "full", transport "http"
    and engines that declare `assembles_shares` (`weightsync serve`); every rank's engine
    clients send (give every rank the same engines)."""
    digest_algorithm: str | None = None
    """How bucket digests are computed, one of `weightsync.digests.ALGORITHMS`. None: by
    where the transport's buffers live: "wsmix64" on a device (CUDA buckets are hashed
    in place), "xxh3_64" on the CPU (faster there)."""
    commit: str = "staged"
    """How engines commit a push (`manifest.COMMITS`, docs/GUARANTEES.md): "staged", each
    engine stages the whole update and swaps it in (all or nothing, across replicas too;
    memory: the update staged beside the model); "streamed", each bucket is loaded into the
    served weights once its digest checks and let go (memory: the buckets in flight; no
    generation from begin to commit; a push that fails midway leaves an engine refusing
    generation until a full push lands, and its next push goes whole). "streamed" needs
    engines that declare `streams_commit` and fan_out "direct"; "lora" adapters always go staged."""

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
        check_fan_out(self.fan_out)
        if self.commit not in COMMITS:
            raise ValueError(f"unknown commit {self.commit!r}; one of {', '.join(COMMITS)}")
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
        self.ranks = TrainerRanks(process_group, send_rank=send_rank)
        self._transport: Transport | None = given
        """The sending rank's transport (given, or made by name); the other ranks have none."""
        self._mode = make_mode(self.config.mode, ModeOptions(
            adapter_name=self.config.adapter_name, lora_prefix=self.config.lora_prefix,
            lora_keep=self.config.lora_keep, sparse_snapshot=self.config.sparse_snapshot,
            commit=self.config.commit))
        """What pushes send, and what that mode remembers between pushes."""
        algorithm = self.config.digest_algorithm
        if self._mode.digests_from_parts and self.ranks.is_distributed and algorithm not in (None, *COMBINABLE):
            raise ValueError(f"mode={mode!r} with a process_group digests each whole tensor from its ranks' parts, "
                             f"which only {', '.join(sorted(COMBINABLE))} can: leave digest_algorithm unset or "
                             f"pass {', '.join(repr(a) for a in sorted(COMBINABLE))}")
        self._fan_out = make_fan_out(self.config.fan_out, transport=self.config.transport,
                                     send_shares=self.config.send_shares, mode=self.config.mode,
                                     sends_shares=self._mode.sends_shares, digest_algorithm=algorithm,
                                     commit=self.config.commit)
        """How a push's bytes reach the engines (`weightsync.push.fanout`), chosen once."""
        self._replicas = Replicas(engines, timeout_s=self.config.timeout_s,
                                  cleanup_timeout_s=self.config.cleanup_timeout_s, transport=self.config.transport,
                                  mode=self.config.mode, sends_adapter=self._mode.sends_adapter,
                                  fan_out=self._fan_out)
        """The engines, called together, each round bounded (`weightsync.push.replicas`)."""
        if self.ranks.is_sender:
            # now: an engine that cannot take the transport, or a missing transport option, fails here
            self._replicas.refuse_unfit(self._make_transport())
            if self.config.disk_root is not None:
                Path(self.config.disk_root).mkdir(parents=True, exist_ok=True)
        self._buckets = BucketPlanner(self.config.rename)
        self._expert_layout: ExpertLayout = "per-expert"
        """The expert layout of the push under way, which other trainer ranks read in too."""
        self.owner = session_owner()
        """This trainer's identity on the engines: its sessions are never taken by another
        live trainer, and it takes over those of a dead one (see `weightsync.receive.takeover`)."""
        self._share_buffers: list[torch.Tensor] = []
        """`send_shares`: this rank's share buffers, kept across pushes."""
        self._closed = False

    # -- public ------------------------------------------------------------

    @property
    def engines(self) -> list[Engine]:
        """The engines every push goes to."""
        return self._replicas.engines

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
            return follow(model, self._mode, self.ranks, adapter_name=self.config.adapter_name,
                          timeout_s=self.config.timeout_s, send=self._send_shares)
        backlog = self._replicas.backlog
        try:
            backlog.wait(self.config.timeout_s, f"the push of v{version}")
            report = self._push(model, version)
        except BaseException as e:
            self._mode.failed(version)
            owed = backlog.owed_labels()
            if owed:
                e.add_note(f"{', '.join(owed)} did not answer within timeout_s: the rest of the cleanup (abort, "
                           "leaving the session, resume) goes out in the background; the next push waits for it")
            if isinstance(e, WeightSyncError):
                self._tell_followers({"error": f"{type(e).__name__}: {e}"})
            raise
        finally:
            backlog.start()
        self._tell_followers({"report": report.to_dict()})
        return report

    def close(self) -> None:
        """Tear down the transport session and leave every engine's group."""
        if self._closed:
            return
        self._closed = True
        backlog = self._replicas.backlog
        try:
            backlog.wait(self.config.timeout_s, "closing")
        except SyncTimeoutError as e:
            log.warning("%s", e)
        self._mode.close(self._planner(self._mode, Stages(), planned=False))
        self._replicas.leave(self._transport)
        backlog.start()
        self._replicas.pool.shutdown(wait=False)

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one push ----------------------------------------------------------

    def _push(self, model: Any, version: int) -> SyncReport:
        """The mode's phases, each plan -> begin -> stream -> commit -> verify."""
        started = time.perf_counter()
        self._handshake(model)
        planner = self._planner(self._mode, Stages())
        phases = []
        for first in self._mode.prepare(model, version, planner):
            phases.append(self._push_phase(first, model, version, self._planner(first, Stages())))
        report = self._push_phase(self._mode, model, version, planner)
        return replace(report, seconds=time.perf_counter() - started, phases=tuple(phases))

    def _push_phase(self, mode: PushMode, model: Any, version: int, planner: PushPlanner) -> SyncReport:
        """One mode's push of `version`, verified."""
        started = time.perf_counter()
        quantization = planner.casts.quantization(cast=mode.casts)
        if quantization is not None and self.ranks.is_distributed:
            raise CastError(f"the engines serve quantized weights ({quantization.format.kind}); quantizing in the "
                            "stream of a sharded trainer is not supported yet: push from one rank")
        source = quantized_source(mode.source(model, expert_layout=self._expert_layout), quantization)
        held = {m.hf_name: m.dtype for m in planner.metas(source)}  # as the trainer holds them (sparse: metas are cast)
        while True:
            plan = self._plan(mode, source, version, planner, held)
            try:
                manifest, acks, begin_notes = self._transfer(mode, plan, source, planner.stages)
            except _Refused:
                continue  # the mode chose again (delta: the whole model)
            break
        unchecked = [a.engine for a in acks if not digest_checked(a)]
        notes = begin_notes + [f"{e}: the engine reports no digests (stock SGLang); update not digest-verified"
                               for e in unchecked]
        metas = plan.selection.metas
        entries = list(manifest.entries())
        encodings = Counter(e.encoding for e in entries)
        notes += cast_notes(plan.cast, metas, held)
        mode.committed(plan.selection, version, planner)
        return SyncReport(
            version=version, mode=manifest.mode, transport=self.config.transport, num_bytes=manifest.num_bytes,
            num_tensors=len(metas), num_buckets=len(manifest.buckets), seconds=time.perf_counter() - started,
            stages=planner.stages.frozen(), verified=not unchecked, acks=tuple(acks), commit=manifest.commit,
            num_skipped=plan.selection.num_skipped, notes=tuple(notes),
            num_elements=sum(e.numel if e.is_dense else e.num_changed for e in entries),
            encodings={k: encodings[k] for k in ENCODINGS if k in encodings},
        )

    def _plan(self, mode: PushMode, source: WeightSource, version: int, planner: PushPlanner,
              held: Mapping[str, torch.dtype]) -> PushPlan:
        """What the mode selects, renamed, cast and cut into buckets; checked before a byte moves.
        `held`: every tensor of `source` -> its dtype."""
        cast = planner.cast
        selection = mode.select(source, version, planner)
        buckets = self._buckets.plan(
            held, selection.metas, cast=cast, bucket_bytes=self.config.bucket_bytes,
            in_one_bucket=selection.lora_config is not None and self._make_transport().adapter_in_one_bucket)
        manifest = Manifest(
            version=version, mode=selection.mode, buckets=buckets.buckets,
            lora_config=selection.lora_config, lora_name=selection.lora_name,
            base_version=selection.base_version, owner=self.owner, timeout_s=self.config.timeout_s,
            digest_algorithm=selection.digest_algorithm or planner.digest_algorithm,
            commit="staged" if selection.lora_config is not None else self.config.commit,
        )
        return PushPlan(selection=selection, buckets=buckets, cast=cast, manifest=manifest)

    def _transfer(self, mode: PushMode, plan: PushPlan, source: WeightSource,
                  stages: Stages) -> tuple[Manifest, list[Ack], list[str]]:
        """begin, stream, commit on every engine: (the manifest with its digests, acks, notes
        of begin). On any failure every engine is left on its last version; raises
        `_Refused` (nothing moved) when an engine refused at begin and the mode plans again."""
        manifest, version, replicas = plan.manifest, plan.manifest.version, self._replicas
        caps = replicas.capabilities()
        adopting = manifest.commit == "staged" and all(c.adopts_shm for c in caps)  # streamed: copied, let go
        replicas.join(self._make_transport(), max_bucket_bytes=max((b.nbytes for b in manifest.buckets), default=1),
                      leased_buckets=len(manifest.buckets) if adopting else 0)
        replicas.open_updates(manifest, self.config.pause)
        paused = begun = committing = failed = False
        begin_notes: list[str] = []

        def begin() -> None:
            nonlocal begun, begin_notes
            try:
                begin_notes = replicas.begin(manifest)
            except EngineError as e:
                if mode.refused(plan.selection, e):
                    raise _Refused from e
                raise
            except SyncTimeoutError:
                begun = True  # the engine may still open the update when it answers: abort it
                raise
            begun = True
            replicas.start(manifest)

        try:
            if manifest.commit == "streamed" or not all(c.stages_updates for c in caps):
                paused = True  # before asking: a pause that timed out may land when the engine wakes
                replicas.pause(self.config.pause)
            assert self._transport is not None
            step = plan.selection.follower_step
            order = {"mode": source.mode, "order": plan.buckets.order, "expert_layout": self._expert_layout,
                     **({"step": step} if step else {})}
            # the fan-out begins (at once, or while the first bucket is packed) and streams
            digests = self._fan_out.stream(Streaming(
                manifest=manifest, source=source, stream=plan.selection.stream or source,
                bucket_order=plan.buckets.order, to_engine=plan.buckets.to_engine, follower_order=order,
                transport=self._transport, ranks=self.ranks, stages=stages,
                allow_overflow=self.config.allow_overflow, begin=begin, tell_followers=self._tell_followers,
                deliver=self._deliver, send_shares=self._send_shares))
            manifest = manifest.with_digests(digests)
            self._transport.finish(manifest)
            if not paused:
                paused = True
                replicas.pause(self.config.pause, streamed=True)
            replicas.ready(manifest)
            t0 = time.perf_counter()
            committing = True
            acks = replicas.commit(manifest)
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
                replicas.resume(self.config.pause,
                                self.config.cleanup_timeout_s if failed else self.config.timeout_s)
            replicas.settled()
        return manifest, acks, begin_notes

    def _deliver(self, bucket: BucketMeta, buffer: torch.Tensor) -> None:
        """Hand one packed bucket to the transport and every engine (per-bucket transports)."""
        transport = self._transport
        assert transport is not None
        delivery = transport.deliver(bucket, buffer)
        if transport.per_bucket_delivery:
            self._replicas.receive(bucket, delivery, lambda: transport.send(bucket, buffer))

    def _send_shares(self, source: WeightSource, order: ShareOrder, stages: Stages | None = None) -> list[str]:
        """This rank's share of every bucket to the engines as the fan-out routes them (the sending
        rank's `SharesFanOut.stream`, or the sender told this rank to); on the sender, their digests."""
        return send_shares(source, order, self.ranks, deliver=self._replicas.receive_share,
                           timeout_s=self.config.timeout_s, allow_overflow=self.config.allow_overflow,
                           stages=stages, buffers=self._share_buffers) or []

    def _fail(self, version: int, begun: bool, error: BaseException, *, committing: bool = False) -> None:
        """Leave every engine on its last good version after `error`; `committing`: it came in
        the commit round, so some engines may have committed."""
        log.warning("push of v%d failed: %s", version, error)
        self._replicas.failing()  # every cleanup round below shares one bound
        if begun:
            self._replicas.abort(version)
        if committing:
            self._replicas.roll_back(version, error)
        if self._transport is not None:
            self._transport.discard(version)
        if not self._make_transport().survives_failure or isinstance(error, SyncTimeoutError):
            self._replicas.leave(self._transport)

    # -- the transport session ---------------------------------------------

    def _make_transport(self) -> Transport:
        """The trainer side of the transport, made on first use and kept."""
        if self._transport is None:
            self._transport = make_transport(
                self.config.transport, timeout_s=self.config.timeout_s, disk_root=self.config.disk_root,
                keep_versions=self.config.keep_versions, master_address=self.config.master_address,
                backend=self.config.backend, relay=self._fan_out.relays,
            )
        return self._transport

    # -- what a push is planned with ------------------------------------------

    def _handshake(self, model: Any) -> None:
        """The push's first step: every engine's capabilities, asked once per transport session
        (`Replicas.handshake`), and what they decide before planning: the expert layout the
        engines load (they must agree where `model` has experts)."""
        self._replicas.handshake()
        if self.config.commit == "streamed":
            unable = [label for label, c in self._replicas.by_label().items() if not c.streams_commit]
            if unable:
                raise EngineError(unable[0], f"commit='streamed' needs engines that load each bucket as it arrives "
                                  f"(streams_commit); {', '.join(unable)} cannot: use commit='staged'")
        self._expert_layout = expert_layout(self._replicas.expert_layouts(), model)

    def _planner(self, mode: PushMode, stages: Stages, *, planned: bool = True) -> PushPlanner:
        """What `mode` plans one phase of a push with, as plain values: what the handshake answered
        (none yet at a close before any push), the config, the session's digest algorithm, the
        dtype the mode's tensors travel in (not `planned`, at a close: nothing is cast)."""
        assert self.config.dtype is None or isinstance(self.config.dtype, torch.dtype)
        asked = self._replicas.asked
        casts = Casts(forced=self.config.dtype, served=self._replicas.by_label() if asked else {},
                      to_engine=self.config.rename)
        return PushPlanner(self._replicas, self.ranks, stages=stages, allow_overflow=self.config.allow_overflow,
                           digest_algorithm=self._digest_algorithm(),
                           capabilities=self._replicas.capabilities() if asked else (), casts=casts,
                           cast=casts.of(cast=mode.casts) if planned else Cast(), expert_layout=self._expert_layout)

    def _digest_algorithm(self) -> str:
        """The algorithm of this session's digests (see `SyncConfig.digest_algorithm`); by where the
        transport's buffers live (a trainer rank that does not send has no transport: it hashes on CPU)."""
        device = self._transport.buffer_device if self._transport is not None else torch.device("cpu")
        return self._fan_out.digest_algorithm(lambda: self.config.digest_algorithm or for_device(device))

    def _tell_followers(self, message: dict[str, Any]) -> None:
        """Tell the other trainer ranks (`weightsync.push.followers`) what comes next."""
        self.ranks.share(message, timeout_s=self.config.timeout_s)


class _Refused(Exception):
    """An engine refused the manifest at begin and the mode chose to plan again."""
