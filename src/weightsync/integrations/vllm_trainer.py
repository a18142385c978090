"""vLLM's trainer API for the `"weightsync"` backend: `trainer_init(WeightSyncTrainerInitInfo(...))`, then
`send_weights()`, each one `ws.WeightSync.push` through a `VLLMTransferEngine`.

Imports vLLM: use it where vLLM is installed. Usage and the source shapes it takes
(vLLM 0.32's and 0.33's `WeightSource`): docs/VLLM.md, "The trainer side".
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from weightsync.engines.vllm.plugin import BACKEND, register
from weightsync.engines.vllm.transfer_client import VLLMTransferEngine
from weightsync.manifest import TensorMeta
from weightsync.reports import SyncReport

log = logging.getLogger(__name__)


@dataclass
class WeightSyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the `"weightsync"` backend: `ws.WeightSync`'s options."""

    backend: ClassVar[str] = BACKEND

    transport: str
    """"shm" (same host), "disk" (needs `disk_root`) or "broadcast" (gloo/NCCL group)."""
    bucket_bytes: int = 256 << 20
    """Bucket size in bytes."""
    pause: str = "retract"
    """The pause policy around each commit (`ws.PausePolicy` names)."""
    timeout_s: float = 60.0
    """Bound on every engine call of a push."""
    disk_root: str | None = None
    """The shared directory of the disk transport."""
    answer_dir: str | None = None
    """Where the workers answer (`VLLMTransferEngine`; default: see there)."""
    answer_host: str | None = None
    """Answer through a TCP store on this address of the trainer's host instead."""


class WeightSyncTrainerEngine(TrainerWeightTransferEngine[WeightSyncTrainerInitInfo]):
    """vLLM's trainer engine for `"weightsync"`: each `send_weights` is one verified push."""

    init_info_cls = WeightSyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool, engine: VLLMTransferEngine,
                 info: WeightSyncTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        import weightsync as ws

        self.engine = engine
        engines: list[Any] = [engine]  # VLLMEngine's transports are computed class attributes, as Engine allows
        self.sync = ws.WeightSync(engines, transport=info.transport, bucket_bytes=info.bucket_bytes,
                                  pause=info.pause, timeout_s=info.timeout_s, disk_root=info.disk_root)
        self.last_report: SyncReport | None = None
        """The report of the last `send_weights`."""

    @classmethod
    def trainer_init(cls, init_info: WeightSyncTrainerInitInfo, *, client: Any, source: Any = None) -> Self:
        if source is None:
            raise ValueError("the weightsync trainer engine needs a source: ModuleSource(model) or a WeightSource")
        if not init_info.is_sender:
            raise ValueError(f"trainer rank {init_info.rank}: the weightsync vLLM backend drives one sending rank; "
                             "for FSDP use ws.WeightSync(..., process_group=...) on every rank")
        engine = _engine_for(client, init_info)
        engine.capabilities(init_info.timeout_s)  # initialises the workers' engines (init_weight_transfer_engine)
        return cls(client=client, source=source, is_sender=True, engine=engine, info=init_info)

    def send_weights(self) -> None:
        assert self.source is not None
        version = int(self.engine.info()["version"]) + 1
        self.last_report = self.sync.push(_as_pushable(self.source), version=version)

    def shutdown(self) -> None:
        self.sync.close()
        self.engine.close()


def _engine_for(client: Any, info: WeightSyncTrainerInitInfo) -> VLLMTransferEngine:
    """The weightsync engine behind vLLM's `client` argument."""
    if isinstance(client, VLLMTransferEngine):
        return client
    base_url = getattr(client, "base_url", None)
    if isinstance(base_url, str):  # vLLM's HTTPVLLMWeightSyncClient
        return VLLMTransferEngine(base_url, timeout_s=info.timeout_s, answer_dir=info.answer_dir,
                                  answer_host=info.answer_host)
    if hasattr(client, "llm_engine"):  # an in-process vllm.LLM
        return VLLMTransferEngine.from_llm(client, timeout_s=info.timeout_s, answer_dir=info.answer_dir,
                                           answer_host=info.answer_host)
    raise ValueError(f"client {type(client).__name__}: pass the vllm.LLM, vLLM's HTTPVLLMWeightSyncClient or a "
                     "weightsync VLLMTransferEngine (the weightsync backend also resets the prefix cache, which the "
                     "four-verb client protocol cannot)")


class _VLLMSource:
    """A vLLM `WeightSource` as a weightsync one (names as the source gives them), in either
    of vLLM's two shapes, read from what the source's class declares (never vLLM's version):

    - vLLM <= 0.32: `metadata()` is a method; iterating the source (`__iter__`) yields
      every parameter as a full tensor.
    - vLLM 0.33: `metadata` is a `functools.cached_property` (a list); `iter_full()`
      yields the full tensor of each name `owned_names(rank)` gives, in metadata order
      (`iter_local()`, a rank's shard, is for M2N backends and not read here).

    The weightsync backend sends from one rank, `rank`, which must own every parameter.
    """

    mode = "full"

    def __init__(self, source: Any, *, rank: int = 0) -> None:
        self.source = source
        self.rank = rank
        cls = type(source)
        self._full_iterator = callable(getattr(cls, "iter_full", None))
        """vLLM 0.33's shape: the tensors come from `iter_full()`."""
        if not self._full_iterator and not callable(getattr(cls, "__iter__", None)):
            raise TypeError(f"{cls.__name__} is no vLLM WeightSource: it has neither iter_full() (vLLM 0.33) nor "
                            "__iter__ (vLLM <= 0.32)")
        implements = getattr(source, "implements_iter_full", None)
        if self._full_iterator and callable(implements) and not implements():
            raise ValueError(f"{cls.__name__} implements only iter_local() (each rank's shard); the weightsync "
                             "backend sends full tensors: implement iter_full()")
        declared = inspect.getattr_static(cls, "metadata", None)
        self._metadata_is_attribute = isinstance(declared, (functools.cached_property, property))
        """vLLM 0.33 declares `metadata` a cached_property; earlier vLLMs a method."""

    def _metadata(self) -> list[Any]:
        metadata = self.source.metadata if self._metadata_is_attribute else self.source.metadata()
        return list(metadata)

    def metas(self) -> Sequence[TensorMeta]:
        metadata = self._metadata()
        if self._full_iterator:
            owned = set(self.source.owned_names(self.rank))
            orphans = [m.name for m in metadata if m.name not in owned]
            if orphans:
                raise ValueError(f"trainer rank {self.rank} does not own {orphans[0]!r} "
                                 f"({len(orphans)} parameters in all), so it cannot send it: the weightsync vLLM "
                                 "backend sends every parameter from one rank; for sharded trainers use "
                                 "ws.WeightSync(..., process_group=...) on every rank")
        return [TensorMeta(hf_name=m.name, shape=tuple(m.shape), dtype=m.dtype) for m in metadata]

    def _stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One fresh pass over the source, in its own order."""
        return iter(self.source.iter_full() if self._full_iterator else self.source)

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        if hf_names is None:
            yield from self._stream()
            return
        wanted = list(hf_names)
        held: dict[str, torch.Tensor] = {}  # the source's order is its own: hold until asked
        want = set(wanted)
        it = self._stream()
        for hf_name in wanted:
            while hf_name not in held:
                try:
                    name, tensor = next(it)
                except StopIteration:
                    raise ValueError(f"the vLLM WeightSource yielded no {hf_name!r}, which its metadata "
                                     "declares; metadata and iteration must agree") from None
                if name in want:
                    held[name] = tensor
            yield hf_name, held.pop(hf_name)


def _as_pushable(source: Any) -> Any:
    """vLLM's `ModuleSource(model)` -> the module (weightsync walks its tree for names);
    any other vLLM WeightSource -> an adapter."""
    module = getattr(source, "_module", None)
    return module if isinstance(module, torch.nn.Module) else _VLLMSource(source)


register()  # importing this module is enough for vLLM's trainer factory to find the backend

__all__ = ["WeightSyncTrainerEngine", "WeightSyncTrainerInitInfo"]
