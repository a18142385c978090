"""weightsync inside every vLLM worker: the worker extension and `WorkerSync`, the worker's update state.

vLLM mixes `WeightSyncWorkerExtension` into its worker class (`worker_extension_cls=EXTENSION`);
the client (`client.VLLMEngine`) calls its `weightsync_*` methods on every worker through
`collective_rpc`, one JSON string in, a JSON-able dict out. `WorkerSync` also serves the
weight-transfer backend (`transfer_engine.py`). The design: docs/VLLM.md, "The worker".
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from weightsync.dtypes import dtype_name
from weightsync.engines.vllm.adapters import AdapterDirs, check_adapter
from weightsync.engines.vllm.quantized import check_quantized_update, probe_layers, served_quantization
from weightsync.engines.vllm.reload import (
    PACKED_MODULES,
    fused_groups,
    layer_groups,
    moe_kernels_rebuilt,
    moe_layer_names,
)
from weightsync.errors import (
    ConflictError,
    EngineError,
    IntegrityError,
    ManifestMismatchError,
    StagingMemoryError,
    WeightSyncError,
    format_names,
)
from weightsync.formats.quantized import Quantization, expected_dtype
from weightsync.formats.version_dir import read_checkpoint_metas
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta, Manifest, TensorMeta
from weightsync.process_memory import heap_given_back, trim_heap, trimmed_between
from weightsync.receive.receive_path import ReceiveHooks, ReceivePath
from weightsync.receive.update_session import OpenUpdate, SessionRules, UpdateSession
from weightsync.reports import Ack
from weightsync.transports import make_receiver, parse_link

if TYPE_CHECKING:  # the staging segment loads transports.shmem: only where a TP engine stages
    from weightsync.engines.vllm.staging import HostStaging

log = logging.getLogger(__name__)

EXTENSION = "weightsync.engines.vllm.worker.WeightSyncWorkerExtension"
"""The qualified name to pass as vLLM's `worker_extension_cls`."""

MAX_SESSIONS = 4
"""Sessions a worker stays joined to at once per transport (broadcast groups, shm
segments), one per trainer: `transports.make_receiver(..., max_sessions=MAX_SESSIONS)`."""
SESSION_TIMEOUT_S = 60.0
"""How long an update from a client that sent no timeout_s may stay silent before
another trainer's begin may take it."""
DELTA_REFUSED = ("delta updates are not applied by the vLLM extension (its in-place reload needs every tensor "
                 "of a layer); send mode='full'")
"""Why a delta is refused (409: the coordinator then sends the whole model); see docs/VLLM.md."""


# --- the extension -------------------------------------------------------------


class WeightSyncWorkerExtension:
    """weightsync's protocol verbs on a vLLM worker (mixed into vLLM's worker class).

    Each verb runs on every worker of the engine (its TP x PP ranks); each
    worker receives every byte of the update (vLLM's loader shards it).
    """

    def weightsync_info(self, request: str = "{}") -> dict[str, Any]:
        """This worker's rank, the engine's rank count, version and LoRA support."""
        return _call(self, "info", request)

    def weightsync_connect(self, request: str) -> dict[str, Any]:
        """`{"link"}`: join the link's session through its transport's receiver
        (broadcast: the group; shm: map the segment)."""
        return _call(self, "connect", request)

    def weightsync_disconnect(self, request: str) -> dict[str, Any]:
        """`{"link"}`: leave the session; never fails for a gone peer."""
        return _call(self, "disconnect", request)

    def weightsync_begin(self, request: str) -> dict[str, Any]:
        """`{"manifest", "link"}`: dry-run check and open a staging session."""
        return _call(self, "begin", request)

    def weightsync_receive(self, request: str) -> dict[str, Any]:
        """`{"version", "index", "digest", "delivery"}`: fetch one bucket through the
        open link's transport receiver, verify and stage it."""
        return _call(self, "receive", request)

    def weightsync_seal(self, request: str) -> dict[str, Any]:
        """`{"version", "digests"}`: check everything the commit would (disk: read the
        version now), and every bucket's digest against the trainer's, applying nothing:
        every rank seals before any rank commits."""
        return _call(self, "seal", request)

    def weightsync_commit(self, request: str) -> dict[str, Any]:
        """`{"version"}`: apply the staged update and ack it (LoRA: and say where it is)."""
        return _call(self, "commit", request)

    def weightsync_abort(self, request: str) -> dict[str, Any]:
        """`{"version"}`: drop the staged update; weights untouched. Idempotent."""
        return _call(self, "abort", request)

    def weightsync_forget_lora(self, request: str) -> dict[str, Any]:
        """`{"lora_name"}`: the adapter was unloaded; delete its directory later."""
        return _call(self, "forget_lora", request)


def _call(worker: Any, verb: str, request: str) -> dict[str, Any]:
    """The RPC boundary: parse the request, run the verb, turn any failure into data.

    Nothing escapes: an exception raised in a worker reaches the client as a bare
    message (HTTP 500 from the server's /collective_rpc), losing its type and fields.
    """
    rank = None
    try:
        state = _state(worker)
        rank = state.rank
        body = json.loads(request) if request else {}
        if not isinstance(body, dict):
            raise ValueError(f"weightsync_{verb}: the request must be a JSON object")
        result = getattr(state, verb)(body)
        return {"ok": True, "rank": rank, **result}
    except Exception as e:  # the RPC boundary: every failure goes back as data
        log.warning("weightsync_%s failed on rank %s: %s", verb, rank, e, exc_info=not isinstance(e, WeightSyncError))
        return {"ok": False, "rank": rank, "error": error_payload(e)}


def error_payload(e: BaseException) -> dict[str, Any]:
    """A JSON form of an error that `engines.vllm.client` turns back into the same error type."""
    payload: dict[str, Any] = {"type": type(e).__name__, "message": str(e)}
    if isinstance(e, ConflictError):  # a state clash, as the embedded engine's HTTP 409
        payload.update(type="EngineError", status=409, retry_after_s=e.retry_after_s)
    if isinstance(e, StagingMemoryError):  # too big to stage here, as the embedded engine's HTTP 413
        payload.update(type="EngineError", status=413, retry_after_s=None)
    if isinstance(e, EngineError):
        payload["message"] = e.remote_message
        payload["status"] = e.status
        payload["retry_after_s"] = e.retry_after_s
    if isinstance(e, ManifestMismatchError):
        payload.update(missing=list(e.missing), unexpected=list(e.unexpected), mismatched=list(e.mismatched))
    return payload


def _state(worker: Any) -> WorkerSync:
    state = worker.__dict__.get("_weightsync_state")
    if state is None:
        state = WorkerSync(worker)
        worker.__dict__["_weightsync_state"] = state
    return state


# --- the state of one worker ---------------------------------------------------


class WorkerSync:
    """weightsync's state in one vLLM worker: links, version, adapters, and the
    `receive.update_session.Applier` of its update session (`self.session`).

    `worker` is vLLM's worker object (`model_runner`, `vllm_config`,
    `reload_weights`); it is only read, except through `reload_weights`.
    """

    def __init__(self, worker: Any, *, refuse_delta: str | None = DELTA_REFUSED,
                 packed_modules: Mapping[str, Sequence[str]] | None = None) -> None:
        """`refuse_delta`: why delta updates are refused (409), or None to apply them
        (the caller sends every tensor of each fused layer it changes). `packed_modules`:
        the model's `packed_modules_mapping` (default: the worker's model's, else
        `PACKED_MODULES`)."""
        self.worker = worker
        self._packed = packed_modules
        self._moe_layers: Sequence[str] | None = None
        self.rank, self.num_ranks = _engine_rank()
        self.version = 0
        self.dirty = False
        self.probed: dict[str, Any] | None = None
        """The last post-reload probe of a quantized engine's layers on this rank (`probe_layers`):
        the version, the layers probed and the largest relative gap."""
        self.shares_staging = self.num_ranks > 1 and _stages_on_host(worker)
        """The engine's workers on this host stage a staged update once, in one segment they all map
        (`staging.HostStaging`); a one-rank engine, or workers on GPUs, stage their own."""
        self.staging: HostStaging | None = None
        """The shared staging segment of the open update, if it has one."""
        self.session = UpdateSession(self, engine=self.who, rules=SessionRules(
            timeout_s=SESSION_TIMEOUT_S, refuse_delta=refuse_delta,
            num_staging_copies=self.num_ranks if _stages_on_host(worker) else 0))
        """The fit check at begin counts the copies staged on this host: one where the workers share
        it (set at each begin), else one per worker (a LoRA adapter over disk, read by each). A
        worker on a GPU stages on its device, which the check does not count (docs/LIMITS.md)."""
        self.receive_path = ReceivePath(self.session, make_receiver=lambda transport: make_receiver(
            transport, max_sessions=MAX_SESSIONS, device=_device(worker)),
            hooks=ReceiveHooks(bucket_place=self._staging_place))
        """This worker's end of each transport, holding the sessions it joined: up to
        MAX_SESSIONS trainer sessions each (two trainers may be connected at once; one
        holds the update, the other waits). Every bucket is copied (vLLM reloads copies)."""
        self.link: Link | None = None
        """The link of the open update (set by a successful begin)."""
        self.adapters = AdapterDirs()
        """The PEFT directories of the adapters this worker took (engine rank 0 writes them)."""
        self._expected: dict[str, TensorMeta] | None = None
        self._kept: dict[str, torch.dtype] | None = None
        self._quantization: Quantization | None = None
        self.held: dict[str, torch.Tensor] = {}
        """Checkpoint name -> the served tensor as the last committed update left it (what
        sparse updates apply on top of); empty until a full update commits."""
        self.keeps_base = False
        """Keep `held` (one model copy): from the first sparse update a trainer begins on;
        until then no memory is spent on it (that first one is refused, 409, and the
        coordinator's full push that follows fills `held`)."""

        self.refusing: str | None = None
        """Why this worker's weights are a mix of two versions (a streamed update failed after a
        bucket loaded), until a full update commits; the client keeps vLLM paused meanwhile."""
        self._stream: StreamedReload | None = None
        """The streamed update loading, between `hold` and `finish` or `abandon`."""

    def not_one_version(self) -> str | None:
        return self.refusing or ("its last commit failed midway" if self.dirty else None)

    # -- verbs -------------------------------------------------------------

    def info(self, body: Mapping[str, Any]) -> dict[str, Any]:
        lora_config = self.worker.vllm_config.lora_config
        return {
            "num_ranks": self.num_ranks, "version": self.version, "dirty": self.dirty, "refusing": self.refusing,
            "open_version": None if self.session.open_update is None else self.session.open_update.version,
            "lora_enabled": lora_config is not None,
            "max_lora_rank": lora_config.max_lora_rank if lora_config is not None else None,
            "model": str(self.worker.vllm_config.model_config.model),
            "dtype": dtype_name(self.worker.vllm_config.model_config.dtype),
            "kept_dtypes": {name: dtype_name(d) for name, d in self.kept_dtypes().items()
                            if name in (self._expected_metas() or {})},
            **({"quantization": q.to_dict(), "probed": self.probed} if (q := self.quantization()) else {}),
        }

    def connect(self, body: Mapping[str, Any]) -> dict[str, Any]:
        link = parse_link(body["link"])
        self.receive_path.receiver(link.transport).join(link, rank=self.rank)
        return {}

    def disconnect(self, body: Mapping[str, Any]) -> dict[str, Any]:
        link = parse_link(body["link"])
        self.receive_path.receiver(link.transport).leave(link)
        return {}

    def begin(self, body: Mapping[str, Any]) -> dict[str, Any]:
        manifest = Manifest.from_dict(body["manifest"])
        link = parse_link(body["link"])
        try:
            self.receive_path.receiver(link.transport).check_joined(link)
        except LookupError as e:
            raise EngineError(self.who, str(e)) from None
        if (q := self.quantization()) is not None:
            check_quantized_update(manifest, self._expected_metas() or {}, q, who=self.who)
        if manifest.mode == "sparse":
            self.keeps_base = True
            group = fused_groups(manifest.hf_names, self._expected_metas() or self.held, self.packed_modules,
                                 self.moe_layers)
            unheld = [n for n in group if n not in self.held]
            if unheld or not self.held:  # refused now (409: the coordinator sends the whole model), not at commit
                raise ConflictError(f"{self.who} holds no copy of {format_names(unheld or ['the served weights'])}, "
                                    "which vLLM must reload with the tensors sent; send a full update")
        if manifest.commit == "streamed":
            self._check_streamed(manifest)
        if self.dirty and manifest.mode == "full":
            log.warning("rank %d: the last commit failed midway; this full update repairs it", self.rank)
        receiver = self.receive_path.receiver(link.transport)
        lands = not receiver.bytes_in_delivery and not (receiver.reads_at_commit and manifest.is_adapter)
        shares = self.shares_staging and lands and manifest.commit == "staged"  # disk too: read into it at seal
        if _stages_on_host(self.worker):  # the fit check: one copy on this host, or one per worker
            self.session.rules = replace(self.session.rules,
                                         num_staging_copies=1 if shares else self.num_ranks)
        preempted = self.session.begin(manifest)
        self.link = link
        if shares:
            try:
                from weightsync.engines.vllm.staging import HostStaging

                self.staging = HostStaging.join(self._staging_name(manifest), manifest)
            except BaseException:
                self.session.abort(manifest.version)
                raise
        return {"preempted": preempted}

    def receive(self, body: Mapping[str, Any]) -> dict[str, Any]:
        version = int(body["version"])
        if self.link is None:
            raise ConflictError(f"{self.who}: no update has begun here (asked for v{version}); begin one first")
        return {"digest": self.receive_path.receive(self.link, version=version, index=int(body["index"]),
                                                    delivery=Delivery.from_dict(body["delivery"]),
                                                    digest_hex=str(body["digest"]))}

    def seal(self, body: Mapping[str, Any]) -> dict[str, Any]:
        version = int(body["version"])
        self.receive_path.read_at_commit(self.link, version)
        self.session.seal(version, body.get("digests"))
        return {}

    def commit(self, body: Mapping[str, Any]) -> dict[str, Any]:
        version = int(body["version"])
        update = self.session.open_update
        ack = self.commit_update(version)
        assert update is not None  # commit found it open
        if not update.manifest.is_adapter:
            return {"ack": ack.to_wire()}
        return {"ack": ack.to_wire(), "lora_path": str(self.adapters.last) if self.adapters.last is not None else None}

    def commit_update(self, version: int) -> Ack:
        """Commit the open update `version` (`ReceivePath.commit`) and return its ack, its memory
        figures counting a shared staging segment in the worker that made it only."""
        staging = self.staging
        ack = self.receive_path.commit(version, self.link)
        if staging is None or staging.created:
            return ack
        mapped = any(t.untyped_storage().data_ptr() == staging.base_ptr for t in self.held.values())
        return replace(ack, peak_extra_bytes=None if ack.peak_extra_bytes is None else max(
            0, ack.peak_extra_bytes - staging.nbytes), kept_bytes=ack.kept_bytes - staging.nbytes
            if ack.kept_bytes is not None and mapped else ack.kept_bytes)

    def abort(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Drop the open update of that version, unless it belongs to another trainer."""
        self.session.abort(int(body["version"]), owner=body.get("owner"))
        return {}

    def forget_lora(self, body: Mapping[str, Any]) -> dict[str, Any]:
        self.adapters.forget(str(body["lora_name"]))
        return {}

    # -- the receive.update_session.Applier of the update session ----------

    def expected(self) -> Mapping[str, TensorMeta] | None:
        return self._expected_metas()

    def _model(self) -> Any:
        """vLLM's model in this worker (None where the worker object has none to show)."""
        return getattr(self.worker, "model", None) or getattr(getattr(self.worker, "model_runner", None), "model",
                                                               None)

    @property
    def packed_modules(self) -> Mapping[str, Sequence[str]]:
        """The model's fused linears (vLLM's `packed_modules_mapping`)."""
        if self._packed is None:
            self._packed = getattr(self._model(), "packed_modules_mapping", None) or PACKED_MODULES
        return self._packed

    @property
    def moe_layers(self) -> Sequence[str]:
        """Checkpoint prefixes of the model's MoE layers (`moe_layer_names`)."""
        if self._moe_layers is None:
            self._moe_layers = moe_layer_names(self._model())
        return self._moe_layers

    def fused_groups(self) -> list[tuple[str, ...]]:
        """The served checkpoint's tensors that vLLM reloads together (`layer_groups`)."""
        return layer_groups(self._expected_metas() or self.held, self.packed_modules, self.moe_layers)

    def base_tensor(self, hf_name: str) -> torch.Tensor | None:
        """The served tensor as this worker holds it (`held`), for a sparse update."""
        return self.held.get(hf_name)

    def apply(self, update: OpenUpdate) -> list[str]:
        manifest = update.manifest
        sent = list(manifest.hf_names)
        tensors = dict(update.tensors)
        if manifest.mode == "sparse":  # the whole fused group of every touched tensor, from `held`
            group = [n for n in fused_groups(sent, self._expected_metas() or self.held, self.packed_modules,
                                             self.moe_layers)
                     if n not in tensors]
            unheld = [n for n in group if n not in self.held]
            if unheld:
                raise ConflictError(f"{self.who} holds no copy of {format_names(unheld)}, which vLLM must "
                                    "reload with the tensors sent; send a full update")
            tensors.update((n, self.held[n]) for n in group)
        loaded: list[str] = []

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in tensors.items():
                loaded.append(name)
                yield name, tensor

        self.dirty = True  # until reload_weights returns: a failure midway leaves a mix
        before, self.held = self.held, {}  # no copy to patch until this reload succeeds
        try:
            self._reload(weights())
            if len(loaded) != len(tensors):
                raise IntegrityError(f"vLLM's loader took {len(loaded)} of {len(tensors)} tensors; "
                                     "the weights are a mix: push a full update")
            if (q := self.quantization()) is not None:  # what the reload serves, checked on each rank
                layers, gap = probe_layers(self._model(), tensors, q, self.packed_modules, who=self.who)
                self.probed = {"version": manifest.version, "layers": layers, "largest_gap": gap}
        except BaseException as e:  # what vLLM serves is no version: `vllm serve` stays paused (client.resume)
            self.refusing = (f"update v{manifest.version} failed in vLLM's reload, after which the weights are no "
                             f"one version: {type(e).__name__}: {e}; push a full update")
            raise
        self.dirty, self.refusing = False, None
        self.version = manifest.version
        if self.keeps_base:  # the staged tensors are this worker's own copies, kept past the update
            self.held = {**before, **tensors} if manifest.mode == "sparse" else dict(tensors)
        log.info("rank %d: now serving weight version %d (%d tensors sent, %d reloaded)", self.rank, self.version,
                 len(sent), len(loaded))
        return sent

    # -- the receive.update_session.StreamedLoader of streamed commits ------------------------

    def _check_streamed(self, manifest: Manifest) -> None:
        """What a streamed update into vLLM cannot be, refused at begin (409) before a byte moves."""
        if self.quantization() is not None:
            raise ConflictError(f"{self.who} serves quantized weights, checked once a whole layer and its scales "
                                "reloaded: it takes no streamed commit; send commit='staged'")
        if manifest.mode != "full":
            raise ConflictError(f"{self.who} takes a streamed update whole (mode 'full'), not {manifest.mode!r}; "
                                "send a full update")

    def hold(self, update: OpenUpdate) -> None:
        """A streamed update begins. A worker cannot stop vLLM generating: the client paused the
        engine before this begin, and keeps it paused where the update fails midway."""
        self._stream = StreamedReload(layer_groups(update.manifest.hf_names, self.packed_modules, self.moe_layers))
        self.held = {}  # the served tensors change from the first bucket on: no copy to patch

    def load(self, update: OpenUpdate, tensors: Mapping[str, torch.Tensor]) -> None:
        """Reload every vLLM layer whose checkpoint tensors have all arrived; keep a copy of the
        others until the rest of their layer comes (a fused layer split between two buckets)."""
        assert self._stream is not None, "hold() first"
        ready = self._stream.take(tensors)
        if not ready:
            return
        self.dirty = self._stream.started = True  # from the first reload until finish: a mix if it stops
        self.refusing = (f"streamed update v{update.version} is loading: the weights are a mix of two versions "
                         "until it commits")
        with quiet_partial_reload():
            self._reload(ready.items())
        self._stream.loaded.extend(ready)

    def _reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's layerwise reload of `weights` (checkpoint names), its MoE kernels rebuilt, and
        what it frees of each layer given back before the next (`heap_given_back`,
        `trimmed_between`): the reload holds about the layer in hand beyond the model."""
        with moe_kernels_rebuilt(self._model()), heap_given_back():
            weights = trimmed_between(weights, lambda item: item[1].nbytes)
            self.worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

    def finish(self, update: OpenUpdate) -> Sequence[str]:
        stream, self._stream = self._stream, None
        assert stream is not None, "hold() first"
        if stream.pending:
            self.refusing = (f"streamed update v{update.version} ended with {len(stream.pending)} tensor(s) of "
                             f"partly loaded layers never reloaded: {format_names(list(stream.pending))}; "
                             "push a full update")
            raise IntegrityError(self.refusing)
        self.dirty, self.refusing = False, None
        self.version = update.manifest.version
        log.info("rank %d: now serving weight version %d (streamed, %d tensors reloaded)", self.rank, self.version,
                 len(stream.loaded))
        return stream.loaded

    def abandon(self, update: OpenUpdate, reason: str) -> None:
        stream, self._stream = self._stream, None
        if stream is not None and stream.started:
            self.refusing = (f"streamed update v{update.version} stopped after reloading {len(stream.loaded)} of "
                             f"{len(update.manifest.hf_names)} tensor(s): {reason}. The weights are neither "
                             f"v{self.version} nor v{update.version}; vLLM stays paused until a full push lands")
            log.warning("rank %d: %s", self.rank, self.refusing)

    def install_adapter(self, update: OpenUpdate) -> None:
        """Write the verified adapter as a PEFT directory (`adapters.AdapterDirs`)."""
        self.version = update.manifest.version  # one counter for weights and adapters, as in the embedded engine
        self.adapters.write(update.manifest, update.tensors, rank=self.rank)

    def release(self, update: OpenUpdate) -> None:
        """Drop the update's staging (its buffers, or this worker's map of the shared segment, whose
        name goes) and give the freed heap back to the system (`trim_heap`: glibc keeps freed
        buckets otherwise), so that after a commit nothing beyond the model is kept, except `held`."""
        update.tensors, update.buffers, update.views = {}, [], {}
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.close()
        trim_heap()

    def _staging_place(self, version: int, bucket: BucketMeta) -> torch.Tensor | None:
        """Where bucket `bucket` of update `version` lands: its region of the shared segment, if the update has one."""
        update = self.session.open_update
        if self.staging is None or update is None or update.version != version:
            return None
        return self.staging.bucket(bucket.index)

    def _staging_name(self, manifest: Manifest) -> str:
        """The shared segment's name: the same in every worker of this engine on this host (vLLM's
        instance id, the workers' parent process), one per update."""
        from weightsync.engines.vllm.staging import staging_name

        return staging_name(str(getattr(self.worker.vllm_config, "instance_id", "")), manifest,
                            engine_pid=os.getppid())

    def check_adapter(self, manifest: Manifest) -> None:
        check_adapter(manifest, self.worker.vllm_config.lora_config, self._expected_metas() or {}, who=self.who)

    def _expected_metas(self) -> dict[str, TensorMeta] | None:
        """Checkpoint name -> dtype and full shape of what this vLLM serves, or None
        (with a warning) where the checkpoint has no safetensors headers to read."""
        if self._expected is None:
            model_config = self.worker.vllm_config.model_config
            directory = _checkpoint_dir(model_config, self.worker.vllm_config.load_config)
            try:
                metas = read_checkpoint_metas(directory) if directory is not None else []
            except FileNotFoundError:
                metas = []
            if not metas:
                log.warning("no safetensors checkpoint found for %s: updates are not dry-run checked",
                            model_config.model)
                return None
            kept = self.kept_dtypes()
            served = model_config.dtype
            self._quantization = served_quantization(model_config.hf_config, metas)
            scales = self._quantization.scales if self._quantization else {}
            self._expected = {  # quantized weights and their scales: as the checkpoint holds them
                m.hf_name: TensorMeta(hf_name=m.hf_name, shape=m.shape,
                                      dtype=expected_dtype(m.hf_name, m.dtype, served, kept, scales))
                for m in metas
            }
        return self._expected

    def quantization(self) -> Quantization | None:
        """What this vLLM serves quantized (`engines.vllm.quantized`), from its checkpoint."""
        self._expected_metas()
        return self._quantization

    def kept_dtypes(self) -> dict[str, torch.dtype]:
        """Checkpoint names vLLM holds in a floating dtype other than the one it serves, under
        the same name: a GLM-4.5 or DeepSeek-V3 router's weight and `e_score_correction_bias`
        stay float32 in a bfloat16 vLLM (`GateLinear(params_dtype=torch.float32)`). Its loader
        would cast whatever arrives into them; weightsync sends their own dtype instead."""
        if self._kept is None:
            served = self.worker.vllm_config.model_config.dtype
            model = self._model()
            if model is None:
                return {}
            held = [*model.named_parameters(), *model.named_buffers()]
            self._kept = {name: t.dtype for name, t in held if t.is_floating_point() and t.dtype != served}
        return self._kept

    # -- helpers -----------------------------------------------------------

    @property
    def who(self) -> str:
        """This worker, for messages."""
        return f"vLLM worker rank {self.rank}"


class StreamedReload:
    """What a streamed update has reloaded, and the tensors of layers still incomplete."""

    def __init__(self, groups: Sequence[tuple[str, ...]]) -> None:
        self.group_of = {name: group for group in groups for name in group}
        """Checkpoint name -> every tensor of the update that vLLM reloads with it (`layer_groups`)."""
        self.pending: dict[str, torch.Tensor] = {}
        """Copies of the tensors whose layer has not all arrived."""
        self.loaded: list[str] = []
        """The tensors reloaded so far."""
        self.started = False
        """A reload began: the served weights may no longer be one version."""

    def take(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors now ready to reload, `tensors` (views let go after the call) with the
        pending ones they complete; the rest of `tensors` copied into `pending`."""
        arrived = {**self.pending, **tensors}
        ready = {name: t for name, t in arrived.items()
                 if all(member in arrived for member in self.group_of.get(name, (name,)))}
        for name in ready:
            self.pending.pop(name, None)
        self.pending.update((name, t.clone()) for name, t in tensors.items() if name not in ready)
        return ready


@contextmanager
def quiet_partial_reload() -> Iterator[None]:
    """Around a reload of some layers: vLLM warns of every layer and weight it was not given
    (each bucket of a streamed update would list the whole model again); errors still show."""
    names = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


# --- free functions ------------------------------------------------------------


def _engine_rank() -> tuple[int, int]:
    """(this worker's rank within its engine, the engine's rank count): TP x PP."""
    from vllm.distributed import parallel_state

    tp, pp = parallel_state.get_tp_group(), parallel_state.get_pp_group()
    return tp.rank_in_group + tp.world_size * pp.rank_in_group, tp.world_size * pp.world_size


def _stages_on_host(worker: Any) -> bool:
    """The worker's received buckets land in host memory (a CPU worker; on a GPU they land on
    its device, where the host's available memory says nothing)."""
    device = _device(worker)
    return device is not None and device.type == "cpu"


def _device(worker: Any) -> torch.device | None:
    """The worker's device, where NCCL receives land (None: the current CUDA device)."""
    device = getattr(worker, "device", None)
    return device if isinstance(device, torch.device) else None


def _checkpoint_dir(model_config: Any, load_config: Any) -> Path | None:
    """The local directory of the checkpoint vLLM loaded (a local path, or the
    Hugging Face cache snapshot it downloaded)."""
    model = str(model_config.model)
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=model_config.revision, cache_dir=load_config.download_dir,
                                      allow_patterns=["*.safetensors"], local_files_only=True))
    except Exception as e:  # not in the local cache (or no hub): nothing to check against
        log.warning("cannot find the checkpoint of %s locally: %s", model, e)
        return None


__all__ = ["EXTENSION", "WeightSyncWorkerExtension", "WorkerSync", "error_payload"]
