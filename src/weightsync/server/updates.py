"""Staged weight updates: sessions, versions, atomic commits and digests.

Every update route ends here. Received tensors are checked (names, shapes,
dtypes, bucket digests) and staged in buffers this engine owns; the served
parameters change only in a commit, which points them at the staged tensors
in between two generation steps (no copy: the staged bytes become the served
weights). So every forward pass uses exactly one version, and an update that
fails, is aborted or never completes leaves the served weights bit-identical.

Served parameters may thus view received bucket buffers. A buffer goes back
to the receive pool only when no parameter views it any more; a buffer that a
partial (delta) commit leaves partly served is compacted: its remaining
tensors are cloned out, so served memory stays the size of the model.

At most one session is open:
- "weightsync": opened by `/weightsync/begin` with a manifest; buckets arrive
  by index (HTTP frame, shared memory, broadcast with weightsync keys, a disk
  version directory) or as named tensors; `/weightsync/commit` applies them.
- "sglang": opened by `/begin_weight_update`; SGLang-shaped routes stage named
  tensors into it; `/end_weight_update` applies them.
With no session open, an SGLang-shaped update is staged and applied within
its own call.

What is served carries two names (`ServedVersion`): weightsync's integer
version, which orders updates (a push's version must be newer; a delta names
its base), and SGLang's `weight_version` label, a free string. A weightsync
push of version N serves N, labelled "N" unless the request gave a label. An
SGLang-shaped update serves current + 1 under the label it gave, or keeps the
label when it gave none, as SGLang does; labels may repeat (slime sends one
label on every bucket of a multi-request update, each applied on arrival).
`/update_weight_version` changes the label only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightsync.bucketing import entry_view, pack_one
from weightsync.checkpoint import read_version
from weightsync.errors import IntegrityError, format_names
from weightsync.integrity import BucketHasher, check_bucket, check_fits, check_manifest_fits, digest
from weightsync.naming import map_names
from weightsync.server import lora
from weightsync.server.buffers import BufferPool
from weightsync.server.errors import ConflictError, NotFoundError
from weightsync.server.requests import ServedVersion
from weightsync.sessions import Holder, SessionBusyError, take_over
from weightsync.types import Manifest, TensorMeta

log = logging.getLogger(__name__)

NamedTensors = Sequence[tuple[str, torch.Tensor]]


@dataclass(eq=False)
class Session:
    """An open update: what was staged so far."""

    kind: str
    """"weightsync" or "sglang"."""
    version: int | None
    """The version the commit produces (None for sglang sessions: current + 1 at the end)."""
    label: str | None = None
    """SGLang's `weight_version` given by the latest request that staged into this
    session; None: a weightsync commit labels "N", an sglang one keeps the label."""
    manifest: Manifest | None = None
    """The manifest given at /weightsync/begin."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> staged copy (views of owned bucket buffers, or clones)."""
    bucket_digests: dict[int, str] = field(default_factory=dict)
    """Digests computed on receipt of whole buckets."""
    buffers: list[torch.Tensor] = field(default_factory=list)
    """The whole-bucket buffers `tensors` views; back to the pool once unused."""
    touched: float = field(default_factory=time.monotonic)
    """The owner's last request or received bucket."""
    owner: str | None = None
    """The trainer that opened it (from the manifest)."""
    timeout_s: float | None = None
    """How long that trainer may stay silent before another may take the session."""

    def expected(self) -> dict[str, TensorMeta]:
        assert self.manifest is not None
        return {e.hf_name: e.meta for e in self.manifest.entries()}


@dataclass(frozen=True)
class StageResult:
    """What a SGLang-shaped update call did."""

    message: str
    ack: dict[str, Any] | None = None
    """Set when the call committed (no session was open)."""


class WeightUpdater:
    """The served weights, their version and the one open update session."""

    def __init__(self, model: nn.Module, *, version: int, label: str | None = None,
                 between_steps: Callable[[], ContextManager[None]], session_timeout_s: float,
                 lora_store: lora.LoraStore | None = None) -> None:
        self.model = model
        self.params: dict[str, torch.Tensor] = {p.hf_name: p.param for p in map_names(model).params}
        self.metas: dict[str, TensorMeta] = {n: TensorMeta.of(n, p) for n, p in self.params.items()}
        self.served = ServedVersion(version, str(version) if label is None else label)
        """The served version and label; replaced whole, only between two steps, read lock-free."""
        self.between_steps = between_steps
        """Context manager holding generation between two steps (the scheduler's)."""
        self.session_timeout_s = session_timeout_s
        self.lora_store = lora_store
        self._lock = threading.RLock()
        self._session: Session | None = None
        self.buffers = BufferPool(max_bytes=sum(m.nbytes for m in self.metas.values()))
        """Receive buffers reused across updates (take one per bucket received)."""
        self._backing: dict[str, torch.Tensor] = {}
        """hf_name -> the received bucket buffer its served parameter views."""

    # -- served weights ----------------------------------------------------------------------

    @property
    def version(self) -> int:
        """weightsync's served version."""
        return self.served.version

    @property
    def label(self) -> str:
        """SGLang's served `weight_version` label."""
        return self.served.label

    def digests(self, names: Iterable[str] | None = None) -> tuple[int, dict[str, str]]:
        """(version, hf_name -> xxh3 digest) of the served weights, read between two steps."""
        names = list(self.params) if names is None else list(names)
        unknown = [n for n in names if n not in self.params]
        if unknown:
            raise NotFoundError(f"unknown weight name(s): {format_names(unknown)}")
        with self.between_steps():
            return self.version, {n: digest(self.params[n].detach()) for n in names}

    def weights_by_name(self, name: str, truncate_size: int) -> tuple[list[Any], str]:
        """SGLang's `get_weights_by_name`: `tensor.tolist()[:truncate_size]` in float32, and the digest."""
        param = self.params.get(name)
        if param is None and name == "lm_head.weight" and getattr(self.model.config, "tie_word_embeddings", False):
            param = self.params.get("model.embed_tokens.weight")
        if param is None:
            raise NotFoundError(f"unknown weight name {name!r}; see /weightsync/info for the served names")
        with self.between_steps():
            values = param.detach().to(torch.float32).tolist()
            return (values[:truncate_size] if isinstance(values, list) else values), digest(param.detach())

    def set_label(self, label: str) -> None:
        """`/update_weight_version`: a new label for the same weights (the version stays)."""
        with self._lock, self.between_steps():
            self.served = ServedVersion(self.version, label)

    # -- weightsync sessions -----------------------------------------------------------------

    @property
    def session(self) -> Session | None:
        return self._session

    def begin(self, manifest: Manifest) -> str | None:
        """Dry-run check of `manifest` against the served model, then open a session.

        An open session gives way by `weightsync.sessions.take_over`: to its own owner,
        or when its owner is gone or silent past its timeout (returns what was
        discarded); a live owner's session is never taken (ConflictError with
        `retry_after_s`)."""
        with self._lock:
            self._expire_idle()
            preempted = None
            session = self._session
            if session is not None:
                if session.kind == "sglang" and not session.tensors:
                    self._session = None  # an empty SGLang session gives way
                else:
                    holder = Holder(owner=session.owner, version=session.version, touched=session.touched,
                                    timeout_s=session.timeout_s or self.session_timeout_s)
                    try:
                        preempted = take_over(holder, manifest.owner, time.monotonic())
                    except SessionBusyError as e:
                        raise ConflictError(str(e), retry_after_s=e.retry_after_s) from None
                    log.warning("update v%s: %s", manifest.version, preempted or "its own trainer begins again")
            self._check_newer(manifest.version, adapter=manifest.mode == "lora")
            self._check_manifest(manifest)
            if self._session is not None:
                self._drop(self._session)
            self._session = Session(kind="weightsync", version=manifest.version, manifest=manifest,
                                    owner=manifest.owner, timeout_s=manifest.timeout_s)
            log.info("update v%d (%s, %d buckets) begun", manifest.version, manifest.mode, len(manifest.buckets))
            return preempted

    def _check_manifest(self, manifest: Manifest) -> None:
        if manifest.mode == "lora":
            if self.lora_store is None:
                raise ConflictError("this server was started without --enable-lora; it cannot take a lora update")
            if manifest.lora_config is None:
                raise ValueError("a lora manifest needs lora_config (the adapter_config.json contents)")
            assert manifest.lora_name is not None
            if self.lora_store.is_loaded(manifest.lora_name):
                raise ConflictError(f"LoRA adapter {manifest.lora_name!r} is already loaded; unload it first")
            config = lora.parse_config(manifest.lora_config)
            sent = {e.hf_name: e.meta for e in manifest.entries()}
            lora.check_adapter(self.model, config, sent, lora_name=manifest.lora_name)
            return
        if manifest.mode == "delta" and manifest.base_version != self.version:
            raise ConflictError(
                f"delta update v{manifest.version} applies on top of v{manifest.base_version}, "
                f"but this server serves v{self.version}; send a full update"
            )
        check_manifest_fits(manifest, self.metas, partial=manifest.mode == "delta")

    def stage_bucket(self, *, version: int, index: int, buffer: torch.Tensor, digest_hex: str | None) -> str:
        """Verify one packed bucket and stage it. Takes ownership of `buffer` (a copy the
        caller made). Returns the digest computed here."""
        session = self._require_weightsync(version)
        assert session.manifest is not None
        buckets = session.manifest.buckets
        if not 0 <= index < len(buckets):
            raise ValueError(f"bucket index {index} out of range: update v{version} has {len(buckets)} bucket(s)")
        bucket = buckets[index]
        got = check_bucket(bucket, buffer)
        if digest_hex is not None and got != digest_hex:
            raise IntegrityError(f"bucket {index}: digest {got} != sent {digest_hex} "
                                 f"(first tensor {bucket.hf_names[0] if bucket.entries else '-'!r}); "
                                 "bytes were corrupted in transit")
        with self._lock:
            if self._session is not session:
                raise ConflictError(f"update v{version} was aborted or replaced while bucket {index} arrived")
            for entry in bucket.entries:
                session.tensors[entry.hf_name] = entry_view(buffer, entry)
            session.buffers.append(buffer)
            session.bucket_digests[index] = got
            session.touched = time.monotonic()
        return got

    def commit(self, version: int) -> dict[str, Any]:
        """Apply the open weightsync session; returns the ack."""
        with self._lock:
            session = self._require_weightsync(version)
            manifest = session.manifest
            assert manifest is not None
            missing = [n for n in manifest.hf_names if n not in session.tensors]
            if missing:
                raise ValueError(f"update v{version} cannot commit: {len(missing)} tensor(s) never arrived: "
                                 f"{format_names(missing)}")
            self._check_newer(version, adapter=manifest.mode == "lora")
            digests = [session.bucket_digests.get(b.index) or _digest_staged(b.hf_names, session.tensors)
                       for b in manifest.buckets]
            served = ServedVersion(version, str(version) if session.label is None else session.label)
            if manifest.mode == "lora":
                self._install_adapter(manifest, session.tensors, served)
            else:
                self._swap(session.tensors, served, owners=_owners(session))
            self._drop(session)
            return {"version": version, "digests": digests, "loaded_names": sorted(manifest.hf_names)}

    def _install_adapter(self, manifest: Manifest, tensors: Mapping[str, torch.Tensor],
                         served: ServedVersion) -> None:
        assert self.lora_store is not None and manifest.lora_name is not None and manifest.lora_config is not None
        adapter = lora.build_adapter(self.model, manifest.lora_name, manifest.lora_config, tensors)
        self.lora_store.add(adapter)
        with self.between_steps():
            self.served = served
        log.info("LoRA adapter %s loaded as v%d (%r)", manifest.lora_name, served.version, served.label)

    def abort(self, version: int | None, *, owner: str | None = None) -> bool:
        """Drop the open session (if `version` matches or is None, and it is not another
        owner's); True if one was dropped."""
        with self._lock:
            if self._session is None or (version is not None and self._session.version != version):
                return False
            if owner is not None and self._session.owner not in (None, owner):
                return False
            log.info("update v%s (%s) aborted; served weights unchanged", self._session.version, self._session.kind)
            self._drop(self._session)
            return True

    # -- SGLang-shaped updates ---------------------------------------------------------------

    def begin_sglang(self) -> str:
        with self._lock:
            self._expire_idle()
            if self._session is None:
                self._session = Session(kind="sglang", version=None)
                return "weight update session opened"
            return f"a {self._session.kind} session is already open; updates stage into it"

    def end_sglang(self) -> StageResult:
        with self._lock:
            session = self._session
            if session is None:
                return StageResult("no open weight update session")
            if session.kind == "weightsync":
                return StageResult(f"weightsync session v{session.version} is open; /weightsync/commit applies it")
            self._session = None
            if not session.tensors:
                return StageResult("weight update session closed; nothing was staged")
            return self._apply_sglang(session.tensors, session.label)

    def stage_named(self, named: NamedTensors, *, label: str | None, full: bool = False) -> StageResult:
        """Check and stage named tensors from an SGLang-shaped route (see the module docstring);
        `label` is the request's `weight_version`."""
        with self._lock:
            self._expire_idle()
            session = self._session
            if session is not None and session.kind == "weightsync":
                _check_against(named, session.expected(), what=f"update v{session.version}")
            else:
                _check_against(named, self.metas, what="the served model", full=full)
            if session is None:
                return self._apply_sglang(_copies(named), label)
            session.tensors.update(_copies(named))
            if label is not None:
                session.label = label
            session.touched = time.monotonic()
            if session.kind == "weightsync":
                return StageResult(f"staged {len(named)} tensor(s) into weightsync session v{session.version}")
            return StageResult(f"staged {len(named)} tensor(s); /end_weight_update applies them")

    def _apply_sglang(self, tensors: Mapping[str, torch.Tensor], label: str | None) -> StageResult:
        """Serve `tensors` (checked, owned) as current + 1, under `label` or the current one."""
        served = ServedVersion(self.version + 1, self.label if label is None else label)
        self._swap(tensors, served)
        return StageResult(f"applied {len(tensors)} tensor(s) as v{served.version} ({served.label!r})",
                           ack={"version": served.version, "digests": [], "loaded_names": sorted(tensors)})

    def apply_version_dir(self, directory: Path, *, label: str | None) -> StageResult:
        """A disk version directory (manifest.json + bucket files), every bucket verified,
        applied as one update: into the open weightsync session of the same version
        (which this commits), else through a session of its own. Served as the
        manifest's version, labelled `label` (default: the version's decimal string).
        """
        manifest, buckets = read_version(directory)
        session = self._session
        if session is not None and session.kind == "weightsync":
            assert session.manifest is not None
            if session.version != manifest.version:
                raise ConflictError(f"{directory} holds v{manifest.version}, the open session is v{session.version}")
            if manifest.without_digests().buckets != session.manifest.without_digests().buckets:
                raise ValueError(f"{directory}/manifest.json differs from the manifest given at begin")
        else:
            self.begin(manifest)
        try:
            if label is not None:
                self._require_weightsync(manifest.version).label = label
            for bucket, buffer in buckets:
                self.stage_bucket(version=manifest.version, index=bucket.index, buffer=buffer,
                                  digest_hex=bucket.digest)
            ack = self.commit(manifest.version)
        except BaseException:
            self.abort(manifest.version)
            raise
        return StageResult(f"applied {directory.name} as v{manifest.version}", ack=ack)

    def stage_as_buckets(self, tensors: Mapping[str, torch.Tensor]) -> list[str]:
        """Pack named tensors into the open weightsync session's bucket layout and stage
        every bucket (checked against the manifest's digests where it has them)."""
        session = self._session
        if session is None or session.manifest is None:
            raise ConflictError("no weightsync update session is open")
        manifest = session.manifest
        _check_against(list(tensors.items()), session.expected(), what=f"update v{manifest.version}", full=True)
        digests = []
        for bucket in manifest.buckets:
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
            for entry in bucket.entries:
                pack_one(buffer, entry, tensors[entry.hf_name])
            digests.append(self.stage_bucket(version=manifest.version, index=bucket.index, buffer=buffer,
                                             digest_hex=None))
        return digests

    # -- internals ---------------------------------------------------------------------------

    def _swap(self, staged: Mapping[str, torch.Tensor], served: ServedVersion, *,
              owners: Mapping[str, torch.Tensor] | None = None) -> None:
        """Make the staged tensors the served parameters between two steps, served as `served`.

        The staged tensors are adopted, not copied (they are owned by this update
        and never written again); `owners` names the bucket buffer each one views.
        """
        owners = owners or {}
        for name, tensor in staged.items():
            param = self.params[name]
            assert tensor.shape == param.shape and tensor.dtype == param.dtype, f"unchecked tensor {name}"
            assert tensor.device == param.device and tensor.is_contiguous(), f"unadoptable tensor {name}"
        with self.between_steps():
            for name, tensor in staged.items():
                self.params[name].data = tensor
            self.served = served
            released = self._rebind_backing(staged, owners)
        self.buffers.give(released)
        log.info("v%d (%r) committed (%d tensor(s))", served.version, served.label, len(staged))

    def _rebind_backing(self, staged: Mapping[str, torch.Tensor],
                        owners: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Record which buffers the served parameters now view; return the buffers that
        backed the replaced parameters, which no parameter views any more. Parameters
        left on such a buffer by a partial update are cloned out of it first, so no
        buffer is kept alive for a few of its bytes."""
        replaced = {id(b): b for name in staged if (b := self._backing.pop(name, None)) is not None}
        for name in staged:
            if name in owners:
                self._backing[name] = owners[name]
        for name, buffer in list(self._backing.items()):
            if id(buffer) in replaced:
                self.params[name].data = self.params[name].detach().clone()
                del self._backing[name]
        return list(replaced.values())

    def _drop(self, session: Session) -> None:
        """Close `session` (it is the open one) and give back to the pool the bucket
        buffers that no served parameter views: all of them after an abort, those of
        an adapter (copied at install) after a commit."""
        self._session = None
        session.tensors = {}
        served = {id(b) for b in self._backing.values()}
        self.buffers.give(b for b in session.buffers if id(b) not in served)
        session.buffers = []

    def _check_newer(self, version: int, *, adapter: bool = False) -> None:
        """Versions never go backwards. Base weights need a strictly newer version;
        an adapter may carry the version of the base weights it was trained on
        (a first LoRA push syncs the base and then the adapter as the same step)."""
        if version < self.version or (version == self.version and not adapter):
            raise ConflictError(f"version {version} is not newer than the served v{self.version}; versions must increase")

    def _require_weightsync(self, version: int) -> Session:
        session = self._session
        if session is None or session.kind != "weightsync":
            raise ConflictError(f"no weightsync update session is open (asked for v{version}); call /weightsync/begin")
        if session.version != version:
            raise ConflictError(f"the open update session is v{session.version}, not v{version}")
        return session

    def _expire_idle(self) -> None:
        session = self._session
        if session is not None and time.monotonic() - session.touched > self.session_timeout_s:
            log.warning("discarding update session v%s idle for more than %.0fs", session.version,
                        self.session_timeout_s)
            self._drop(session)


def _check_against(named: NamedTensors, expected: Mapping[str, TensorMeta], *, what: str, full: bool = False) -> None:
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


def _copies(named: NamedTensors) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().contiguous().clone() for name, tensor in named}


def _owners(session: Session) -> dict[str, torch.Tensor]:
    """name -> the session's bucket buffer its staged tensor views (none for clones)."""
    by_storage = {b.untyped_storage().data_ptr(): b for b in session.buffers if b.numel()}
    return {name: buffer for name, t in session.tensors.items()
            if (buffer := by_storage.get(t.untyped_storage().data_ptr())) is not None}


def _digest_staged(hf_names: Sequence[str], tensors: Mapping[str, torch.Tensor]) -> str:
    """A bucket's digest from its staged tensors, in bucket order (== digest of the packed bytes)."""
    hasher = BucketHasher()
    for name in hf_names:
        hasher.update(tensors[name])
    return hasher.hexdigest()
