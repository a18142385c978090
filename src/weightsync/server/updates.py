"""Update sessions of the embedded engine, of either kind, and the applier they commit through.

Every update route ends here: at most one session is open, "weightsync" (`/weightsync/begin`
.. `/weightsync/commit`, buckets arriving through the one receive path, `receive_path`) or
"sglang" (`/begin_weight_update` .. `/end_weight_update`); with none open an SGLang-shaped
update is staged and applied within its own call. Served parameters change only in a commit,
between two generation steps; a failed, aborted or unfinished update leaves them bit-identical
(a streamed one excepted: docs/GUARANTEES.md). Which route ends an update, and the versions and
labels served: docs/PROTOCOL.md ("Details of the embedded engine").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightsync.errors import ConflictError
from weightsync.formats.version_dir import read_version
from weightsync.manifest import Manifest, TensorMeta
from weightsync.process_memory import trim_heap
from weightsync.receive.receive_path import ReceiveHooks, ReceivePath
from weightsync.receive.takeover import Holder, SessionBusyError, take_over
from weightsync.receive.update_session import (
    NamedTensors,
    OpenUpdate,
    SessionRules,
    UpdateSession,
    check_named,
    copies,
)
from weightsync.reports import Ack
from weightsync.server import lora
from weightsync.server.experts import ExpertFuser
from weightsync.server.layouts import Layouts
from weightsync.server.quantized import ServedQuantization
from weightsync.server.requests import ServedVersion
from weightsync.server.rollback import CommitHistory
from weightsync.server.served import ServedWeights
from weightsync.transports import make_receiver

log = logging.getLogger(__name__)

ENGINE = "this server"
"""How the embedded engine names itself in messages and acks."""


@dataclass(eq=False)
class SglangSession:
    """An SGLang-shaped session (`/begin_weight_update`): named tensors staged until
    `/end_weight_update`, served as current + 1."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> staged copy."""
    label: str | None = None
    """The `weight_version` of the latest request that staged into it; None keeps the label."""
    touched: float = field(default_factory=time.monotonic)
    """The last request that staged into it."""


@dataclass(frozen=True)
class StageResult:
    """What a SGLang-shaped update call did."""

    message: str
    ack: Ack | None = None
    """Set when the call committed (no session was open)."""


class WeightUpdater:
    """The one open update session of an engine (weightsync's or SGLang's) over its served weights.

    It is the `receive.update_session.Applier` of its weightsync sessions (`self.session`):
    a commit swaps the staged bucket-buffer views in between two steps."""

    def __init__(self, model: nn.Module, *, version: int, label: str | None = None,
                 between_steps: Callable[[], ContextManager[None]], session_timeout_s: float,
                 lora_store: lora.LoraStore | None = None, staging_bytes_limit: int | None = None,
                 quantized: ServedQuantization | None = None) -> None:
        """`staging_bytes_limit`: `ServerConfig.staging_bytes_limit`. `quantized`: the checkpoint's
        quantization, where `model` serves one dequantized (a push sends the quantized weights)."""
        self.model = model
        self._lock = threading.RLock()
        self.weights = ServedWeights(model, version=version, label=label, between_steps=between_steps,
                                     lock=self._lock)
        """The served parameters, the buffers they view, their version and label."""
        self.experts = ExpertFuser(model)
        """Per-expert checkpoint names (SGLang-shaped routes) into the fused expert parameters."""
        self.session_timeout_s = session_timeout_s
        self.lora_store = lora_store
        self.quantized = quantized
        """What a weightsync push sends quantized, dequantized at commit (`server.quantized`); None: floats."""
        self.history = CommitHistory(self.weights, lora_store, timeout_s=session_timeout_s)
        """The last weightsync commit while it can still be rolled back."""
        self.session = UpdateSession(self, engine=ENGINE, rules=SessionRules(
            timeout_s=session_timeout_s, adapter_keeps_version=True, staging_bytes_limit=staging_bytes_limit))
        """The weightsync update session (at most one session of either kind is open)."""
        self.receive_path = ReceivePath(self.session, make_receiver=make_receiver, hooks=ReceiveHooks(
            alloc=self.weights.buffers.take, serves_received=True, served_buffers=self.weights.served_buffers,
            joins_at_first_bucket=True))
        """The one way bytes reach `session`, whichever route they came by: this engine's end of
        each transport (made on first use, each keeping its session: the shm segment stays
        mapped while its name stays the same), buffers from the receive pool, staging."""
        self._sglang: SglangSession | None = None
        self.loading: int | None = None
        """The streamed update loading into the served weights (no step runs meanwhile)."""
        self._update_label: str | None = None
        """The label the open weightsync update is served under; None: "N"."""
        self.last_manifest: Manifest | None = None
        """The manifest of the last begin, accepted or not: parsing the next one reuses its
        entries where they are the same (`Manifest.from_dict`'s `known`)."""
        self.layouts = Layouts()
        """The layouts of the last begins accepted, which a begin may name instead of sending
        its buckets (`weightsync.server.layouts`)."""

    @property
    def version(self) -> int:
        """weightsync's served version (what a new update must exceed)."""
        return self.weights.version

    def not_one_version(self) -> str | None:
        """Why the served weights are not wholly `version`'s (a delta cannot apply on
        them), or None: SGLang-shaped requests rewrote some parameters since, or the
        weights were released or reset."""
        if self.weights.coverage.dirty:
            return "its weights are not one version's (see partial_update in /weightsync/info)"
        return None

    # -- weightsync sessions -----------------------------------------------------------------

    def session_info(self) -> dict[str, Any] | None:
        """The open session of either kind, for /weightsync/info."""
        now = time.monotonic()
        update, sglang = self.session.open_update, self._sglang
        if update is not None:
            return {"kind": "weightsync", "version": update.version, "label": self._update_label,
                    "owner": update.owner, "timeout_s": update.manifest.timeout_s,
                    "idle_s": round(now - update.touched, 3), "mode": update.manifest.mode,
                    "buckets_received": sorted(update.digests)}
        if sglang is not None:
            return {"kind": "sglang", "version": None, "label": sglang.label, "owner": None, "timeout_s": None,
                    "idle_s": round(now - sglang.touched, 3), "mode": None, "buckets_received": []}
        return None

    def begin(self, manifest: Manifest) -> str | None:
        """Dry-run check of `manifest` against the served model, then open a session
        (see `receive.update_session.UpdateSession.begin`); returns what was discarded. An empty
        SGLang session gives way; one holding tensors is taken like an idle trainer's."""
        with self._lock:
            self.last_manifest = manifest
            self._expire_sglang()  # an open weightsync update is left to the takeover rule
            if self.quantized is not None and not manifest.is_adapter:
                self.quantized.check(manifest, self.weights.metas, who=ENGINE)
            preempted = None
            sglang = self._sglang
            if sglang is not None and sglang.tensors:
                holder = Holder(owner=None, version=None, touched=sglang.touched, timeout_s=self.session_timeout_s)
                try:
                    preempted = take_over(holder, manifest.owner, time.monotonic())
                except SessionBusyError as e:
                    raise ConflictError(str(e), retry_after_s=e.retry_after_s) from None
            preempted = self.session.begin(manifest) or preempted
            self.history.make_final()
            self._sglang = None
            self._update_label = None
            return preempted

    def commit(self, version: int, *, held_slots: Callable[[], Mapping[str, tuple[int, ...]]] | None = None) -> Ack:
        """Apply the open weightsync session; returns the ack (`held_slots`: see
        `receive.update_session.UpdateSession.commit`)."""
        with self._lock:
            return self.session.commit(version, held_slots=held_slots)

    def abort(self, version: int | None, *, owner: str | None = None) -> bool:
        """Drop the open session (if `version` matches or is None, and it is not another
        owner's); True if one was dropped."""
        with self._lock:
            if self.session.abort(version, owner=owner):
                return True
            if version is None and self._sglang is not None:
                log.info("SGLang update session aborted; served weights unchanged")
                self._sglang = None
                return True
            return False

    def rollback(self, version: int, *, owner: str | None = None) -> bool:
        """Undo the commit of `version` (`server.rollback.CommitHistory.rollback`)."""
        with self._lock:
            return self.history.rollback(version, owner=owner)

    # -- the receive.update_session.Applier of weightsync sessions ---------------------------

    def expected(self) -> Mapping[str, TensorMeta]:
        if self.quantized is not None:
            return self.quantized.expected(self.weights.metas)
        return self.weights.metas

    def check_adapter(self, manifest: Manifest) -> None:
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

    def base_tensor(self, hf_name: str) -> torch.Tensor:
        """The served tensor a sparse update is applied to (a copy of), as `receive.update_session.SparseBase`:
        parameters are replaced whole at a staged commit, and written in place only by a
        streamed one, while no step runs and no other update is open, so reading one while
        generation runs is safe."""
        return self.weights.params[hf_name].detach()

    def staging_reused_bytes(self, manifest: Manifest) -> int:
        """As `receive.staging_memory.StagingReuse`: the receive pool's free buffers and the copy
        of the previous version kept for rollback, which the begin lets go (`history.make_final`).
        The pool hands a buffer to a bucket of its exact size only: a layout that changed since
        reuses fewer, and the estimate errs low by at most the pool's size (the served model's). Less,
        on a quantized checkpoint, the copies in the served dtype its commit makes of the quantized
        weights (no received buffer backs them)."""
        reused = self.weights.buffers.free_bytes + self.history.kept_bytes()
        if self.quantized is not None:
            reused -= self.quantized.dequantized_bytes(manifest, self.weights.metas)
        return reused

    def apply(self, update: OpenUpdate) -> Sequence[str]:
        tensors, owners = update.tensors, _owners(update)
        if self.quantized is not None:  # every weight dequantized before anything is served
            refused = f"update v{update.version} refused, {ENGINE} stays on v{self.version}"
            tensors = self.quantized.dequantize(tensors, self.weights.metas, refused=refused)
            owners = {name: buffer for name, buffer in owners.items() if tensors.get(name) is update.tensors[name]}
        served, last = self._served_after(update), self.history.record(update)
        last.replaced = self.weights.swap(tensors, served, owners=owners)
        self.weights.coverage.applied(tensors, label=served.label, atomic=True)
        self.history.keep(last)
        return list(update.tensors)  # the scales too: each was loaded, into its weight

    def install_adapter(self, update: OpenUpdate) -> None:
        manifest, served, last = update.manifest, self._served_after(update), self.history.record(update)
        assert self.lora_store is not None and manifest.lora_name is not None and manifest.lora_config is not None
        adapter = lora.build_adapter(self.model, manifest.lora_name, manifest.lora_config, update.tensors)
        last.adapter = manifest.lora_name
        last.evicted = self.lora_store.add(adapter)
        self.weights.serve(served)
        self.history.keep(last)
        log.info("LoRA adapter %s loaded as v%d (%r)", manifest.lora_name, served.version, served.label)

    # -- the receive.update_session.StreamedLoader of streamed commits -----------------------

    def hold(self, update: OpenUpdate) -> None:
        """No step from now until `finish` or `abandon`; nothing kept to roll back, no receive
        buffer kept for reuse (a streamed update holds at most the buckets in flight)."""
        with self.weights.between_steps():
            self.loading = update.version
        self.history.make_final()
        self.weights.buffers.clear()

    def holding(self) -> str | None:
        """Why no step may run now (the scheduler's `hold`), or None."""
        version = self.loading
        return None if version is None else f"streamed update v{version} is loading"

    def expire_silent(self) -> None:
        """The scheduler's `on_held`: drop a streamed update whose trainer went silent."""
        self.session.drop_if_idle()

    def load(self, update: OpenUpdate, tensors: Mapping[str, torch.Tensor]) -> None:
        self.weights.load_in_place(tensors)

    def finish(self, update: OpenUpdate) -> Sequence[str]:
        served = self._served_after(update)
        with self.weights.between_steps():
            self.weights.coverage.applied(update.loaded, label=served.label, atomic=True)
            self.weights.serve(served)
            self.loading = None
        log.info("v%d (%r) committed streamed (%d tensor(s))", served.version, served.label, len(update.loaded))
        return list(update.loaded)

    def abandon(self, update: OpenUpdate, reason: str) -> None:
        with self.weights.between_steps():
            self.loading = None
            if update.loaded:
                refusal = (f"this server refuses to generate: streamed update v{update.version} stopped after "
                           f"loading {len(update.loaded)} of {len(update.manifest.hf_names)} tensor(s): {reason}. "
                           f"Its weights are neither v{self.version} nor v{update.version}; the next full push "
                           "restores it (a trainer's next push after a failed streamed one goes whole)")
                self.weights.coverage.streamed_failed(update.loaded, refusal)
                log.warning("%s", refusal)

    def release(self, update: OpenUpdate) -> None:
        """Give back to the pool the update's bucket buffers that no served parameter
        views: all of them after an abort, those of an adapter (copied at install)
        after a commit."""
        served = {id(b) for b in self.weights.served_buffers()}
        self.weights.buffers.give(b for b in update.buffers if id(b) not in served)
        if update.manifest.commit == "streamed":  # memory over reuse: keep no receive buffer once it ends
            self.weights.buffers.clear()
            trim_heap()

    def _served_after(self, update: OpenUpdate) -> ServedVersion:
        return ServedVersion(update.version, str(update.version) if self._update_label is None else self._update_label)

    # -- SGLang-shaped updates ---------------------------------------------------------------

    def begin_sglang(self) -> str:
        with self._lock:
            self._expire_idle()
            if self.session.open_update is not None:
                return "a weightsync session is already open; updates stage into it"
            if self._sglang is not None:
                return "a sglang session is already open; updates stage into it"
            self._sglang = SglangSession()
            return "weight update session opened"

    def end_sglang(self) -> StageResult:
        with self._lock:
            update, sglang = self.session.open_update, self._sglang
            if update is not None:
                return StageResult(f"weightsync session v{update.version} is open; /weightsync/commit applies it")
            if sglang is None:
                return StageResult("no open weight update session")
            self._sglang = None
            if not sglang.tensors:
                return StageResult("weight update session closed; nothing was staged")
            return self._apply_sglang(sglang.tensors, sglang.label)

    def stage_named(self, named: NamedTensors, *, label: str | None, full: bool = False) -> StageResult:
        """Check and stage named tensors from an SGLang-shaped route (see the module docstring);
        `label` is the request's `weight_version`."""
        with self._lock:
            self._expire_idle()
            update, sglang = self.session.open_update, self._sglang
            if update is not None:
                self.session.stage_named(update.version, named)
                if label is not None:
                    self._update_label = label
                return StageResult(f"staged {len(named)} tensor(s) into weightsync session v{update.version}")
            staged = sglang.tensors if sglang is not None else {}
            params = self.weights.params
            named = self.experts.fuse(named, lambda n: staged.get(n, params[n]), full=full)
            check_named(named, self.weights.metas, what="the served model", full=full)
            if sglang is None:
                return self._apply_sglang(copies(named), label)
            sglang.tensors.update(copies(named))
            if label is not None:
                sglang.label = label
            sglang.touched = time.monotonic()
            return StageResult(f"staged {len(named)} tensor(s); /end_weight_update applies them")

    def _apply_sglang(self, tensors: Mapping[str, torch.Tensor], label: str | None) -> StageResult:
        """Serve `tensors` (checked, owned) as current + 1, under `label` or the current one."""
        served = ServedVersion(self.version + 1, self.weights.label if label is None else label)
        self.history.make_final()
        self.weights.buffers.give(self.weights.swap(tensors, served))
        self.weights.coverage.applied(tensors, label=label, atomic=False)
        return StageResult(f"applied {len(tensors)} tensor(s) as v{served.version} ({served.label!r})",
                           ack=Ack(engine=ENGINE, version=served.version, loaded_names=frozenset(tensors)))

    def apply_version_dir(self, directory: Path, *, label: str | None) -> StageResult:
        """A disk version directory (manifest.json + bucket files), every bucket verified,
        applied as one update: into the open weightsync session of the same version
        (which this commits; its manifest.json must be the one given at begin, or the
        session is aborted), else through a session of its own. Served as the manifest's
        version, labelled `label` (default: the version's decimal string).
        """
        manifest, _ = read_version(directory)  # manifest.json checked before anything begins
        update = self.session.open_update
        if update is not None:
            if update.version != manifest.version:
                raise ConflictError(f"{directory} holds v{manifest.version}, the open session is v{update.version}")
        else:
            self.begin(manifest)
        try:
            if label is not None:
                self._update_label = label
            self.receive_path.read_version_dir(directory, manifest.version)
            ack = self.commit(manifest.version)
        except BaseException:
            self.abort(manifest.version)
            raise
        return StageResult(f"applied {directory.name} as v{manifest.version}", ack=ack)

    # -- memory occupation (SGLang's release/resume of "weights") -----------------------------

    def release_weights(self) -> int:
        """Free the served weights (`ServedWeights.release`); returns the bytes freed. Refused
        while an update session is open."""
        with self._lock:
            if self.session_info() is not None:
                raise ConflictError("an update session is open; commit or abort it before releasing the weights")
            self.history.forget()
            return self.weights.release()

    def reset_weights(self, chosen: Callable[[str], bool]) -> list[str]:
        """Overwrite the `chosen` parameters with noise (`ServedWeights.reset`); returns their
        names. Refused while an update session is open."""
        with self._lock:
            if self.session_info() is not None:
                raise ConflictError("an update session is open; commit or abort it before resetting the weights")
            self.history.make_final()
            return self.weights.reset(chosen)

    def resume_weights(self) -> int:
        """Allocate the served weights again, empty (`ServedWeights.resume`); returns the bytes allocated."""
        with self._lock:
            self.history.forget()
            return self.weights.resume()

    # -- internals ---------------------------------------------------------------------------

    def _expire_idle(self) -> None:
        """Discard an update silent past its trainer's timeout, and an SGLang session idle
        for longer than the server's session timeout."""
        self.session.drop_if_idle()
        self._expire_sglang()

    def _expire_sglang(self) -> None:
        sglang = self._sglang
        if sglang is not None and time.monotonic() - sglang.touched > self.session_timeout_s:
            log.warning("discarding the SGLang update session idle for more than %.0fs", self.session_timeout_s)
            self._sglang = None


def _owners(update: OpenUpdate) -> dict[str, torch.Tensor]:
    """name -> the update's bucket buffer its staged tensor views (none for copies, nor for
    the tensors a sparse update rebuilt): a staged tensor that is still the view staged
    from its bucket lives in that bucket's buffer."""
    tensors, buckets = update.tensors, update.manifest.buckets
    owners: dict[str, torch.Tensor] = {}
    for index, (buffer, views) in update.views.items():
        owners.update((name, buffer) for name, view in zip(buckets[index].hf_names, views, strict=True)
                      if tensors.get(name) is view)
    return owners
