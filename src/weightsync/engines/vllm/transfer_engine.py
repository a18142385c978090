"""The worker side of the `"weightsync"` backend of vLLM's weight-transfer API: `WeightSyncTransferEngine`.

One per vLLM worker, driven by vLLM's RL calls; the update itself is `worker.WorkerSync`'s, and
every answer goes to the trainer through `transfer_answers`. The trainer side is
`transfer_client`. The calls of one push: docs/VLLM.md, "The worker engine".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync.engines.vllm.plugin import BACKEND
from weightsync.engines.vllm.transfer_answers import AnswerWriter
from weightsync.engines.vllm.worker import WorkerSync, error_payload
from weightsync.errors import ConflictError, EngineError, IntegrityError, ManifestMismatchError, format_names
from weightsync.manifest import Manifest

log = logging.getLogger(__name__)

LORA_REFUSED = ("LoRA adapters cannot travel through vLLM's weight-transfer API (its engines load base weights "
                "only); start vLLM with weightsync's worker extension and use ws.VLLMEngine for mode='lora'")


@dataclass
class WeightSyncInitInfo(WeightTransferInitInfo):
    """`init_weight_transfer_engine`'s info: where to answer, and a session to join or leave.

    Called once by `trainer_init` and again whenever the trainer opens a new
    transport session; idempotent."""

    answers: dict[str, Any]
    """Where this worker answers (`engines.vllm.transfer_answers.AnswerBox.channel`)."""
    seq: int
    """The trainer's number for this call; the answer carries it."""
    join: dict[str, Any] | None = None
    """A `Link.to_dict()` whose session to join (shm: map the segment; broadcast: join
    the group, which blocks until the trainer forms it)."""
    leave: dict[str, Any] | None = None
    """A `Link.to_dict()` whose session to leave."""


@dataclass
class WeightSyncUpdateInfo(WeightTransferUpdateInfo):
    """One `update_weights` call: exactly one of `begin`, `bucket` and `commit`."""

    seq: int
    """The trainer's number for this call; the answer carries it."""
    answers: dict[str, Any]
    """Where to answer this call and the finish after it (each trainer client has its own)."""
    begin: dict[str, Any] | None = None
    """`{"manifest": Manifest.to_dict(), "link": Link.to_dict()}`: check and open the update."""
    bucket: dict[str, Any] | None = None
    """`{"version", "index", "digest", "delivery"}`: fetch, verify and stage one bucket."""
    commit: int | None = None
    """A version: seal its update (complete, digests the trainer's, shapes checked) for
    `finish_weight_update`."""
    digests: list[str | None] | None = None
    """With `commit`: the trainer's digest of every bucket (the final manifest's)."""

    def __post_init__(self) -> None:
        given = [k for k in ("begin", "bucket", "commit") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a weightsync update_info holds exactly one of begin, bucket and commit; got {given}")


class WeightSyncTransferEngine(WeightTransferEngine[WeightSyncInitInfo, WeightSyncUpdateInfo]):
    """The `"weightsync"` worker engine (one per vLLM worker; docs/VLLM.md)."""

    init_info_cls = WeightSyncInitInfo
    update_info_cls = WeightSyncUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.sync = WorkerSync(_WorkerView(self), refuse_delta=None,
                               packed_modules=getattr(model, "packed_modules_mapping", None))
        self._groups: list[tuple[str, ...]] | None = None
        self._writer: AnswerWriter | None = None
        self._seq = 0
        self._sealed: int | None = None
        """The version a commit call sealed: the next finish applies it."""

    # -- vLLM's lifecycle ----------------------------------------------------------

    def init_transfer_engine(self, init_info: WeightSyncInitInfo) -> None:
        self._answer_on(init_info.answers)
        self._answer(init_info.seq, "init", lambda: self._init(init_info))

    def start_weight_update(self) -> None:
        self._sealed = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's, without its accelerator synchronize (the receivers copy synchronously;
        on CPU there is no accelerator to synchronize)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: WeightSyncUpdateInfo) -> None:
        self._answer_on(update_info.answers)
        if update_info.begin is not None:
            self._answer(update_info.seq, "begin", lambda: self._begin(update_info.begin or {}))
        elif update_info.bucket is not None:
            bucket = update_info.bucket
            if not self._answer(update_info.seq, "bucket", lambda: self.sync.receive(bucket)):
                self.sync.session.abort(int(bucket["version"]))  # nothing of it will be applied
        else:
            version, digests = int(update_info.commit or 0), update_info.digests
            self._answer(update_info.seq, "commit", lambda: self._seal(version, digests))

    def finish_weight_update(self) -> None:
        """Apply the sealed update and ack it; drop an unsealed one (an abort). Returns
        normally either way: the answer tells the trainer which."""
        update = self.sync.session.open_update
        sealed, self._sealed = self._sealed, None
        if update is None or update.version != sealed:
            dropped = None if update is None else update.version
            if dropped is not None:
                log.info("rank %d: update v%d aborted before it was sealed; served weights unchanged",
                         self.sync.rank, dropped)
                self.sync.session.abort(dropped)
            self._answer(self._seq + 1, "finish", lambda: {"aborted": dropped})
            return
        self._answer(self._seq + 1, "finish", lambda: {"ack": self.sync.commit_update(update.version).to_wire()})

    def shutdown(self) -> None:
        self.sync.session.abort()
        self.sync.receive_path.close()

    # -- the steps -----------------------------------------------------------------

    def _init(self, init_info: WeightSyncInitInfo) -> dict[str, Any]:
        if init_info.leave is not None:
            self.sync.disconnect({"link": init_info.leave})
        if init_info.join is not None:
            self.sync.connect({"link": init_info.join})
        return {**self.sync.info({}), "fused_groups": [list(g) for g in self._fused_groups()]}

    def _begin(self, body: Mapping[str, Any]) -> dict[str, Any]:
        manifest = Manifest.from_dict(body["manifest"])
        if manifest.is_adapter:
            raise EngineError(self.sync.who, LORA_REFUSED, status=409)
        if self.sync.expected() is None:
            raise EngineError(self.sync.who, f"cannot check update v{manifest.version} before loading it: no "
                              f"safetensors checkpoint of {self.model_config.model} on this host to read names and "
                              "shapes from; start vLLM from a local checkpoint directory")
        if manifest.mode == "delta":
            self._check_whole_groups(manifest)
        return self.sync.begin(body)

    def _check_whole_groups(self, manifest: Manifest) -> None:
        """A delta must send every checkpoint tensor of each fused layer it touches: the
        layerwise reload rebuilds a layer from what it is given (the rest: garbage)."""
        sent = set(manifest.hf_names)
        for group in self._fused_groups():
            missing = [n for n in group if n not in sent]
            if len(missing) < len(group) and missing:
                raise ConflictError(f"delta v{manifest.version} refused: it sends part of one fused vLLM layer "
                                    f"(missing {format_names(missing)}); send each changed layer's whole group "
                                    "(EngineCapabilities.fused_groups) or a full update")

    def _fused_groups(self) -> list[tuple[str, ...]]:
        if self._groups is None:
            self._groups = self.sync.fused_groups()
        return self._groups

    def _seal(self, version: int, digests: list[str | None] | None) -> dict[str, Any]:
        """Check everything `finish_weight_update` would otherwise find out too late."""
        update = self.sync.session.open_update
        if update is None or update.version != version:
            raise IntegrityError(f"update v{version} cannot commit: it is not open here (aborted, replaced, or a "
                                 f"bucket was refused); open: {None if update is None else update.version}")
        self.sync.seal({"version": version, "digests": digests})  # disk read, complete, the trainer's bytes
        expected = self.sync.expected() or {}
        mismatched = [f"{e.hf_name}: staged {tuple(update.tensors[e.hf_name].shape)}, served "
                      f"{expected[e.hf_name].shape}" for e in update.manifest.entries()
                      if e.hf_name in expected and tuple(update.tensors[e.hf_name].shape) != expected[e.hf_name].shape]
        if mismatched:
            raise ManifestMismatchError(f"update v{version} refused before loading: " + "; ".join(mismatched[:8]),
                                        mismatched=[m.split(":", 1)[0] for m in mismatched])
        self._sealed = version
        return {}

    def _answer_on(self, channel: Mapping[str, Any]) -> None:
        if self._writer is None or self._writer.channel != dict(channel):
            self._writer = AnswerWriter(channel, rank=self.sync.rank)

    def _answer(self, seq: int, verb: str, step: Callable[[], Mapping[str, Any]]) -> bool:
        """Run one step and write its answer for call `seq`; True if it succeeded."""
        self._seq = seq
        assert self._writer is not None, "init_weight_transfer_engine first"
        try:
            result = step()
        except Exception as e:  # the answer boundary: every failure goes back as data
            log.warning("weightsync %s (call %d) failed on rank %d: %s", verb, seq, self.sync.rank, e)
            self._writer.write(seq, {"ok": False, "error": error_payload(e)})
            return False
        self._writer.write(seq, {"ok": True, **result})
        return True


class _WorkerView:
    """What `WorkerSync` asks of a vLLM worker, answered by the transfer engine: its
    config, its device, and an in-place reload through vLLM's layerwise lifecycle."""

    def __init__(self, engine: WeightSyncTransferEngine) -> None:
        self._engine = engine

    @property
    def vllm_config(self) -> Any:
        return self._engine.vllm_config

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def model(self) -> Any:
        return self._engine.model

    def reload_weights(self, *, weights_iterator: Iterable[tuple[str, torch.Tensor]],
                       is_checkpoint_format: bool = True) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        assert is_checkpoint_format
        model: Any = self._engine.model  # a vLLM model: load_weights(iterable) -> loaded names
        initialize_layerwise_reload(model)
        model.load_weights(weights_iterator)
        finalize_layerwise_reload(model, self._engine.model_config)


__all__ = ["BACKEND", "WeightSyncInitInfo", "WeightSyncTransferEngine", "WeightSyncUpdateInfo"]
