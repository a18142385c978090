"""The update session of an engine: the state machine between a trainer's `begin` and its
`commit` or `abort`, and the checks on what arrives (who holds the engine, the version rule,
the manifest's dry run, every bucket's index, size and digest, "every tensor arrived", the
ack; sparse payloads rebuilt and checked whole at commit; a streamed update loaded bucket by
bucket). It moves no bytes (they come through `receive.receive_path.ReceivePath.stage`) and
changes no weight (the engine's `Applier` does). Its errors: docs/ARCHITECTURE.md's design notes.
Thread-safe: buckets may be staged from several threads; begin, commit and abort are serialised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch

from weightsync.bucketing import bucket_views
from weightsync.change_encoding import apply_payload
from weightsync.digests import ALGORITHMS
from weightsync.digests import digest as digest_of
from weightsync.errors import ConflictError, IntegrityError, ManifestError, format_names
from weightsync.integrity import (
    BucketHasher,
    check_bucket,
    check_fits,
    check_manifest_fits,
    manifest_names_digest,
)
from weightsync.manifest import PARTIAL_MODES, BucketMeta, Manifest, TensorMeta
from weightsync.process_memory import MemoryMark, host_available_bytes
from weightsync.receive.staging_memory import StagingReuse, check_staging_fits, staging_bytes
from weightsync.receive.takeover import Holder, SessionBusyError, take_over
from weightsync.reports import Ack

log = logging.getLogger(__name__)

NamedTensors = Sequence[tuple[str, torch.Tensor]]


@dataclass(eq=False)
class OpenUpdate:
    """An update between its begin and its commit or abort: what arrived so far."""

    manifest: Manifest
    """The manifest given at begin."""
    timeout_s: float
    """How long its trainer may stay silent before another may take the session."""
    touched: float = field(default_factory=time.monotonic)
    """Monotonic time of the trainer's last request or staged bucket."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """hf_name -> staged tensor, checked: views of `buffers`, or private copies (a
    sparse entry: its uint8 payload until commit, then the rebuilt tensor)."""
    digests: dict[int, str] = field(default_factory=dict)
    """Bucket index -> the digest computed here on receipt of the whole bucket."""
    buffers: list[torch.Tensor] = field(default_factory=list)
    """The received bucket buffers `tensors` view (the session owns them)."""
    views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)
    """Bucket index -> the buffer it arrived in and the views of it staged for its entries,
    in bucket order (a staged tensor that is still one of them lives in that buffer)."""
    memory: MemoryMark | None = None
    """This process's resident set at begin, the peak mark reset there (None without /proc):
    the ack's `peak_extra_bytes` and `kept_bytes` are measured from it."""
    streamed: bool = False
    """The update is committed streamed (`Manifest.commit`): buckets are loaded as they
    arrive, nothing is staged."""
    loaded: set[str] = field(default_factory=set)
    """Streamed: hf_names loaded into the served weights so far."""
    tensor_digests: dict[str, str] = field(default_factory=dict)
    """Streamed "sparse": hf_name -> the whole digest of each tensor loaded, rebuilt."""
    failure: str | None = None
    """Streamed: what failed while a bucket was loaded (the refusal names it)."""
    sealed: Ack | None = None
    """Set by `UpdateSession.seal`: every check passed, the ack it will commit with
    (its loaded names still to come from the applier)."""

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def owner(self) -> str | None:
        return self.manifest.owner


class Applier(Protocol):
    """What differs between engines: their weights and how a checked update reaches them."""

    @property
    def version(self) -> int:
        """The served weight version."""
        ...

    def not_one_version(self) -> str | None:
        """Why the served weights are not wholly `version`'s, so a delta on top of it
        must be refused; None when they are."""
        ...

    def expected(self) -> Mapping[str, TensorMeta] | None:
        """hf_name -> dtype and shape of every weight a full update must send (a delta
        sends a subset); None where the engine cannot tell (no dry run)."""
        ...

    def check_adapter(self, manifest: Manifest) -> None:
        """Refuse (raise) a lora-mode manifest this engine cannot load."""
        ...

    def apply(self, update: OpenUpdate) -> Sequence[str]:
        """Serve the staged tensors as `update.version`; returns the names loaded."""
        ...

    def install_adapter(self, update: OpenUpdate) -> None:
        """Load the staged lora-mode update as adapter `update.manifest.lora_name`."""
        ...

    def release(self, update: OpenUpdate) -> None:
        """`update` is closed (committed, aborted or replaced): free what it holds."""
        ...


@runtime_checkable
class SparseBase(Protocol):
    """An applier that can apply "sparse" updates: it hands out its served tensors."""

    def base_tensor(self, hf_name: str) -> torch.Tensor | None:
        """The served tensor `hf_name` (checkpoint form, engine dtype), read only: a
        sparse update is applied to a copy of it. None where the engine holds no copy of
        it in checkpoint form (the sparse update is refused at begin with 409)."""
        ...


@runtime_checkable
class StreamedLoader(Protocol):
    """An applier that takes streamed commits: buckets loaded into the served weights as
    they arrive (`Manifest.commit == "streamed"`)."""

    def hold(self, update: OpenUpdate) -> None:
        """`update` begins: generate nothing until `finish` or `abandon`."""
        ...

    def load(self, update: OpenUpdate, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write `tensors` (checked; views of a bucket buffer let go after the call) into the
        served weights, in place."""
        ...

    def finish(self, update: OpenUpdate) -> Sequence[str]:
        """Every tensor of `update` loaded: serve it as `update.version` and generate again;
        returns the names loaded."""
        ...

    def abandon(self, update: OpenUpdate, reason: str) -> None:
        """`update` closed without its commit: generate again where nothing loaded, else
        refuse generation naming `reason` until a full update commits."""
        ...


@dataclass(frozen=True, kw_only=True)
class SessionRules:
    """The points on which engines' sessions differ."""

    timeout_s: float = 60.0
    """How long a trainer whose manifest gave no `timeout_s` may stay silent."""
    adapter_keeps_version: bool = False
    """An adapter may carry the served version (a first LoRA push syncs the base and
    then the adapter as one step); base weights always need a newer one."""
    refuse_delta: str | None = None
    """Why this engine refuses delta updates (HTTP 409, so the trainer sends the whole
    model); None: a delta is applied on top of the version it names as its base."""
    num_staging_copies: int = 1
    """The copies of an update staged on this host (processes that each stage their own; a vLLM
    engine's workers share one, `engines.vllm.staging`)."""
    staging_bytes_limit: int | None = None
    """Bytes a staged update may take beyond what the engine holds at begin, where the host's
    memory figures overstate what it may use (a cgroup's limit); None: the host's figures only."""


class UpdateSession:
    """At most one open update of one engine, from begin to commit or abort."""

    def __init__(self, applier: Applier, *, engine: str, rules: SessionRules | None = None) -> None:
        self.applier = applier
        self.engine = engine
        """Who this is, for messages and acks."""
        self.rules = rules or SessionRules()
        self._lock = threading.RLock()
        self._open: OpenUpdate | None = None
        self.host_available: Callable[[], int | None] = host_available_bytes
        """The bytes this host can still give this process, or None where it cannot tell (no
        check then): asked at the begin of every staged update."""

    @property
    def open_update(self) -> OpenUpdate | None:
        """The open update, if any."""
        return self._open

    def begin(self, manifest: Manifest) -> str | None:
        """Check `manifest` (version, dry run) and open its update.

        An open update gives way by `weightsync.receive.takeover.take_over`: to its own
        trainer, or when that trainer is gone or silent past its timeout (returns
        what was discarded); a live trainer's update is never taken (ConflictError
        with `retry_after_s`). A refused begin leaves the open update as it was.
        """
        with self._lock:
            preempted = None
            current = self._open
            if current is not None:
                holder = Holder(owner=current.owner, version=current.version, touched=current.touched,
                                timeout_s=current.timeout_s)
                try:
                    preempted = take_over(holder, manifest.owner, time.monotonic())
                except SessionBusyError as e:
                    raise ConflictError(str(e), retry_after_s=e.retry_after_s) from None
                log.warning("%s: update v%s replaces v%s: %s", self.engine, manifest.version, current.version,
                            preempted or "its own trainer begins again")
            self._check_newer(manifest)
            self._check_digest_algorithm(manifest)
            self._dry_run(manifest)
            streamed = manifest.commit == "streamed"
            if streamed and not isinstance(self.applier, StreamedLoader):
                raise ConflictError(f"{self.engine} does not take a streamed commit; send commit='staged'")
            if not streamed:
                self._check_fits(manifest, current)
            if current is not None:
                self._close(current, f"update v{manifest.version} replaced it ({preempted or 'its own trainer'})")
            self._open = OpenUpdate(manifest=manifest, timeout_s=manifest.timeout_s or self.rules.timeout_s,
                                    memory=MemoryMark.take(), streamed=streamed)
            if streamed:
                assert isinstance(self.applier, StreamedLoader)
                self.applier.hold(self._open)
            log.info("%s: update v%d (%s, %d buckets) begun", self.engine, manifest.version, manifest.mode,
                     len(manifest.buckets))
            return preempted

    def bucket(self, version: int, index: int) -> BucketMeta:
        """Bucket `index` of the open update `version` (a sign of life of its trainer)."""
        return self._bucket(version, index)[1]

    def open_manifest(self, version: int) -> Manifest:
        """The manifest given at the begin of the open update `version`."""
        with self._lock:
            return self._require(version).manifest

    def digest_algorithm(self, version: int) -> str:
        """The digest algorithm the open update `version` names (for `Receiver.fetch_hashed`)."""
        with self._lock:
            return self._require(version).manifest.digest_algorithm

    def serves_whole(self, version: int) -> bool:
        """The open update `version` replaces whole served tensors with the bytes as sent
        (full, lora-merged), so an engine may serve them from the buffer they arrived in
        (`Receiver.adopt`); adapters, deltas and sparse payloads are copied."""
        with self._lock:
            update = self._require(version)
        return not update.streamed and not update.manifest.is_adapter and update.manifest.mode not in PARTIAL_MODES

    def streams(self, version: int) -> bool:
        """The open update `version` is committed streamed: each bucket is loaded into the
        served weights as it checks and not kept."""
        with self._lock:
            return self._require(version).streamed

    def stage_bucket(self, *, version: int, index: int, buffer: torch.Tensor, digest_hex: str | None = None,
                     computed: str | None = None) -> str:
        """Verify one packed bucket (its size, the manifest's digest, and `digest_hex`,
        the digest sent with it) and stage its tensors as views of `buffer`, which the
        session now owns (a copy the caller made). `computed`: the digest of `buffer`
        this process computed while copying it in (`Receiver.fetch_hashed`), never one
        that came with the bytes. Returns the digest computed here. Its one caller in the
        library is `ReceivePath.stage`."""
        update, bucket = self._bucket(version, index)
        try:
            got = check_bucket(bucket, buffer, update.manifest.digest_algorithm, computed=computed)
            if digest_hex is not None and got != digest_hex:
                raise IntegrityError(f"bucket {index}: digest {got} != sent {digest_hex} "
                                     f"(first tensor {bucket.hf_names[0] if bucket.entries else '-'!r}); "
                                     "bytes were corrupted in transit")
        except IntegrityError as e:
            if update.streamed:
                update.failure = str(e)
            raise
        with self._lock:
            if self._open is not update:
                raise ConflictError(f"update v{version} was aborted or replaced while bucket {index} arrived")
            views = bucket_views(buffer, bucket)
            if update.streamed:
                self._load(update, bucket, views)
                update.digests[index] = got
                update.touched = time.monotonic()
                return got
            update.tensors.update(zip(bucket.hf_names, views, strict=True))
            update.buffers.append(buffer)
            update.views[index] = (buffer, views)
            update.digests[index] = got
            update.touched = time.monotonic()
        return got

    def stage_named(self, version: int, named: NamedTensors) -> None:
        """Stage named tensors (checked against the manifest, copied) into the open update."""
        with self._lock:
            update = self._require(version)
            if update.streamed:
                raise ConflictError(f"update v{version} is committed streamed: it takes buckets by index only")
            check_named(named, {e.hf_name: e.meta for e in update.manifest.entries()},
                        what=f"update v{version}")
            update.tensors.update(copies(named))
            update.touched = time.monotonic()

    def seal(self, version: int, sent_digests: Sequence[str | None] | None = None) -> Ack:
        """Check everything a commit of the open update checks, without applying it:
        every tensor arrived, the version is still newer, every bucket's digest equals
        the trainer's (`sent_digests`, the final manifest's, where given), sparse payloads
        rebuilt and their whole tensors' digests right. Ranks of one engine seal before
        any of them commits, so a rank that would refuse does so while every rank still
        serves the last version. A refused sparse rebuild closes the update (its staging is
        half rebuilt); other refusals leave it open for the trainer's abort. Idempotent
        once sealed."""
        with self._lock:
            update = self._require(version)
            if update.sealed is not None:
                return update.sealed
            manifest = update.manifest
            arrived = update.loaded if update.streamed else update.tensors
            missing = [n for n in manifest.hf_names if n not in arrived]
            if missing:
                raise IntegrityError(f"update v{version} cannot commit: {len(missing)} tensor(s) never arrived: "
                                     f"{format_names(missing)}")
            self._check_newer(manifest)
            digests = tuple(update.digests.get(b.index) or _digest_staged(b.hf_names, update.tensors,
                                                                           manifest.digest_algorithm)
                            for b in manifest.buckets)
            if sent_digests is not None:
                _check_sent(version, digests, sent_digests)
            tensor_digests: dict[str, str] = dict(update.tensor_digests)
            if manifest.mode == "sparse" and not update.streamed:
                try:
                    self._check_base(manifest)
                    tensor_digests = self._rebuild_sparse(update)
                except BaseException:  # payloads may be half rebuilt: this update is done
                    self._close(update, "its sparse payloads did not rebuild")
                    raise
            update.sealed = Ack(engine=self.engine, version=version, digests=digests, tensor_digests=tensor_digests)
            return update.sealed

    def commit(self, version: int, *, held_slots: Callable[[], Mapping[str, tuple[int, ...]]] | None = None) -> Ack:
        """Apply the open update (sealing it first if it is not) and return its ack; the
        update is closed after the applier ran, whether it succeeded or not. `held_slots`:
        asked once the applier ran, the transport slots the served weights now live in
        (`ReceivePath.held_slots`), named in the ack. Where the names loaded are exactly the
        manifest's, the ack also carries their digest (`Ack.names_digest`), which its
        sender may send instead of the list."""
        with self._lock:
            sealed = self.seal(version)
            update = self._require(version)
            try:
                if update.manifest.is_adapter:
                    self.applier.install_adapter(update)
                    loaded: Sequence[str] = update.manifest.hf_names
                elif update.streamed:
                    assert isinstance(self.applier, StreamedLoader)
                    loaded = self.applier.finish(update)
                    update.streamed = False  # committed: nothing to abandon
                else:
                    loaded = self.applier.apply(update)
            finally:
                self._close(update, "its commit failed")
            held = held_slots() if held_slots is not None else {}
            names, sent = frozenset(loaded), update.manifest.hf_names
            exact = len(names) == len(sent) and names == frozenset(sent)  # so their digests are equal too
            peak, kept = _memory_since(update)
            return replace(sealed, loaded_names=names, names_digest=manifest_names_digest(sent) if exact else None,
                           held_slots=dict(held), peak_extra_bytes=peak, kept_bytes=kept)

    def abort(self, version: int | None = None, *, owner: str | None = None) -> bool:
        """Drop the open update (if `version` matches or is None, and it is not another
        trainer's); True if one was dropped. Idempotent; served weights unchanged."""
        with self._lock:
            update = self._open
            if update is None or (version is not None and update.version != version):
                return False
            if owner is not None and update.owner not in (None, owner):
                return False
            self._close(update, "its trainer aborted it")
            peak, kept = _memory_since(update)
            log.info("%s: update v%s aborted%s (peak %s, kept %s bytes beyond begin)", self.engine, update.version,
                     " (streamed)" if update.streamed else "; served weights unchanged", peak, kept)
            return True

    def drop_if_idle(self) -> bool:
        """Drop the open update if its trainer has been silent past its timeout (for calls
        that open no update of their own; a begin goes through the takeover rule)."""
        with self._lock:
            update = self._open
            if update is None or time.monotonic() - update.touched <= update.timeout_s:
                return False
            log.warning("%s: discarding update v%s silent for more than %.0fs", self.engine, update.version,
                        update.timeout_s)
            self._close(update, f"its trainer was silent for more than {update.timeout_s:.0f}s")
            return True

    # -- internals ---------------------------------------------------------------------------

    def _check_newer(self, manifest: Manifest) -> None:
        """Versions never go backwards, and base weights need a strictly newer one."""
        served = self.applier.version
        same_ok = manifest.is_adapter and self.rules.adapter_keeps_version
        if manifest.version < served or (manifest.version == served and not same_ok):
            raise ConflictError(f"version {manifest.version} is not newer than the served v{served}; "
                                "versions must increase")

    def _check_digest_algorithm(self, manifest: Manifest) -> None:
        if manifest.digest_algorithm not in ALGORITHMS:
            raise ManifestError(
                f"update v{manifest.version} refused: {self.engine} does not compute the digest algorithm "
                f"{manifest.digest_algorithm!r} the manifest names; it computes {', '.join(ALGORITHMS)} "
                "(set the trainer's digest_algorithm to one of them)")

    def _dry_run(self, manifest: Manifest) -> None:
        if manifest.is_adapter:
            self.applier.check_adapter(manifest)
            return
        if manifest.mode == "delta" and self.rules.refuse_delta is not None:
            raise ConflictError(self.rules.refuse_delta)
        if manifest.mode == "sparse":
            if not isinstance(self.applier, SparseBase):
                raise ConflictError(f"{self.engine} does not apply sparse updates (it keeps no copy of its "
                                    "served tensors in checkpoint form); send a full update")
            unheld = [e.hf_name for e in manifest.entries() if not e.is_dense
                      and self.applier.base_tensor(e.hf_name) is None]
            if unheld:
                raise ConflictError(f"{self.engine} holds no copy of {format_names(unheld)} as served (none "
                                    "since it started, or its last update failed); send a full update")
        self._check_base(manifest)
        expected = self.applier.expected()
        if expected is not None:
            check_manifest_fits(manifest, expected, partial=manifest.mode in PARTIAL_MODES)

    def _check_fits(self, manifest: Manifest, current: OpenUpdate | None) -> None:
        """Staging `manifest` fits in this host's memory beside what the engine keeps
        (`staging_memory.check_staging_fits`); `current`, the update it replaces, frees its buffers."""
        reused = self.applier.staging_reused_bytes(manifest) if isinstance(self.applier, StagingReuse) else 0
        if current is not None:
            reused += sum(b.numel() * b.element_size() for b in current.buffers)
        needed = max(0, staging_bytes(manifest) - reused) * self.rules.num_staging_copies
        check_staging_fits(manifest, engine=self.engine, needed_bytes=needed,
                           streams=isinstance(self.applier, StreamedLoader), available=self.host_available,
                           limit_bytes=self.rules.staging_bytes_limit)

    def _check_base(self, manifest: Manifest) -> None:
        """A delta or sparse update applies on top of the served version only, and only
        while the served weights are wholly that version's."""
        if manifest.mode not in PARTIAL_MODES:
            return
        if (mixed := self.applier.not_one_version()) is not None:
            raise ConflictError(f"{manifest.mode} update v{manifest.version} refused: {self.engine} serves "
                                f"v{self.applier.version} in name only, {mixed}; send a full update")
        if manifest.base_version != self.applier.version:
            raise ConflictError(
                f"{manifest.mode} update v{manifest.version} applies on top of v{manifest.base_version}, "
                f"but {self.engine} serves v{self.applier.version}; send a full update"
            )

    def _rebuild_sparse(self, update: OpenUpdate) -> dict[str, str]:
        """Apply every sparse payload to a copy of the served tensor (in `update.tensors`),
        then digest every touched tensor whole and check it against the manifest; returns
        hf_name -> digest. Raises IntegrityError naming the tensors that differ (nothing
        served has changed)."""
        manifest = update.manifest
        applier = self.applier
        assert isinstance(applier, SparseBase)
        tensor_digests: dict[str, str] = {}
        wrong = []
        for entry in manifest.entries():
            staged = update.tensors[entry.hf_name]
            if not entry.is_dense:
                base = applier.base_tensor(entry.hf_name)
                if base is None:
                    raise ConflictError(f"{self.engine} no longer holds {entry.hf_name!r} as served; "
                                        "send a full update")
                staged = apply_payload(base, encoding=entry.encoding,
                                       num_changed=entry.num_changed, payload=staged, hf_name=entry.hf_name)
                update.tensors[entry.hf_name] = staged
            got = digest_of(staged.contiguous(), manifest.digest_algorithm)
            tensor_digests[entry.hf_name] = got
            if entry.tensor_digest is not None and got != entry.tensor_digest:
                wrong.append(entry.hf_name)
        if wrong:
            raise IntegrityError(f"sparse update v{manifest.version} refused, {self.engine} stays on "
                                 f"v{applier.version}: {len(wrong)} tensor(s) differ from the trainer's once "
                                 f"applied (whole-tensor digest): {format_names(wrong)}")
        return tensor_digests

    def _bucket(self, version: int, index: int) -> tuple[OpenUpdate, BucketMeta]:
        with self._lock:
            update = self._require(version)
            buckets = update.manifest.buckets
            if not 0 <= index < len(buckets):
                raise ValueError(f"bucket index {index} out of range: update v{version} has {len(buckets)} bucket(s)")
            update.touched = time.monotonic()
            return update, buckets[index]

    def _require(self, version: int) -> OpenUpdate:
        update = self._open
        if update is None:
            raise ConflictError(f"no update session is open (asked for v{version}); begin one first")
        if update.version != version:
            raise ConflictError(f"the open update session is v{update.version}, not v{version}")
        return update

    def _load(self, update: OpenUpdate, bucket: BucketMeta, views: Sequence[torch.Tensor]) -> None:
        """A streamed update's checked bucket into the served weights (the caller holds the
        lock): sparse payloads rebuilt on the served tensors and their whole digests checked
        first, so a bucket that does not check loads nothing of itself."""
        manifest = update.manifest
        tensors = dict(zip(bucket.hf_names, views, strict=True))
        try:
            if manifest.mode == "sparse":
                tensors = self._rebuild_bucket(update, bucket, tensors)
            assert isinstance(self.applier, StreamedLoader)
            self.applier.load(update, tensors)
        except BaseException as e:
            update.failure = f"bucket {bucket.index} did not load: {type(e).__name__}: {e}"
            raise
        update.loaded.update(tensors)

    def _rebuild_bucket(self, update: OpenUpdate, bucket: BucketMeta,
                        tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A streamed sparse bucket's tensors, rebuilt on the served ones and digested whole."""
        applier, manifest = self.applier, update.manifest
        assert isinstance(applier, SparseBase)
        rebuilt, wrong = {}, []
        for entry in bucket.entries:
            tensor = tensors[entry.hf_name]
            if not entry.is_dense:
                base = applier.base_tensor(entry.hf_name)
                if base is None:
                    raise ConflictError(f"{self.engine} no longer holds {entry.hf_name!r} as served")
                tensor = apply_payload(base, encoding=entry.encoding, num_changed=entry.num_changed,
                                       payload=tensor, hf_name=entry.hf_name)
            got = digest_of(tensor.contiguous(), manifest.digest_algorithm)
            if entry.tensor_digest is not None and got != entry.tensor_digest:
                wrong.append(entry.hf_name)
            rebuilt[entry.hf_name] = tensor
            update.tensor_digests[entry.hf_name] = got
        if wrong:
            raise IntegrityError(f"sparse update v{manifest.version}: {len(wrong)} tensor(s) differ from the "
                                 f"trainer's once applied (whole-tensor digest): {format_names(wrong)}")
        return rebuilt

    def _close(self, update: OpenUpdate, reason: str = "it was closed") -> None:
        """`update` ends; `reason`: why, where it ends without its commit (a streamed update
        that loaded a bucket leaves the engine refusing generation, naming it)."""
        if self._open is update:
            self._open = None
        if update.streamed:
            update.streamed = False
            assert isinstance(self.applier, StreamedLoader)
            self.applier.abandon(update, reason if update.failure is None else f"{update.failure}; {reason}")
        self.applier.release(update)
        update.tensors = {}
        update.buffers = []
        update.views = {}


def _memory_since(update: OpenUpdate) -> tuple[int | None, int | None]:
    """(peak bytes beyond begin, bytes kept beyond begin) of this process during `update`, read
    once it is closed (its staging freed); (None, None) where not measured."""
    figures = update.memory.since() if update.memory is not None else None
    return figures if figures is not None else (None, None)


def _check_sent(version: int, here: Sequence[str], sent: Sequence[str | None]) -> None:
    """The staged buckets' digests are the trainer's (IntegrityError naming the first that differ)."""
    if len(sent) != len(here):
        raise IntegrityError(f"update v{version}: the trainer sent {len(sent)} bucket digest(s) for "
                             f"{len(here)} bucket(s)")
    wrong = [f"bucket {i}: {h} here, {t} sent" for i, (h, t) in enumerate(zip(here, sent, strict=True))
             if t is not None and h != t]
    if wrong:
        raise IntegrityError(f"update v{version} refused before loading: the bytes staged here are not the "
                             f"trainer's ({'; '.join(wrong[:4])})")


def check_named(named: NamedTensors, expected: Mapping[str, TensorMeta], *, what: str, full: bool = False) -> None:
    """Names known, shapes and dtypes equal, no duplicates (and every name, with `full`)."""
    sent: dict[str, torch.Tensor] = {}
    duplicates = []
    for name, tensor in named:
        if name in sent:
            duplicates.append(name)
        sent[name] = tensor
    if duplicates:
        raise ValueError(f"tensor(s) sent twice in one update: {format_names(duplicates)}")
    check_fits(
        [TensorMeta.of(name, t) for name, t in sent.items()], expected, partial=not full,
        refused="update refused, served weights unchanged", holder=what,
    )


def copies(named: NamedTensors) -> dict[str, torch.Tensor]:
    """Private contiguous copies of named tensors (the caller's may be reused)."""
    return {name: tensor.detach().contiguous().clone() for name, tensor in named}


def _digest_staged(hf_names: Sequence[str], tensors: Mapping[str, torch.Tensor], algorithm: str) -> str:
    """A bucket's digest from its staged tensors, in bucket order (== digest of the packed bytes)."""
    hasher = BucketHasher(algorithm)
    for name in hf_names:
        hasher.update(tensors[name])
    return hasher.hexdigest()


__all__ = ["Applier", "OpenUpdate", "SessionRules", "SparseBase", "StreamedLoader", "UpdateSession", "check_named",
           "copies"]
