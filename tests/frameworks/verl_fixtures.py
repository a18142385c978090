"""verl's side of the verl tests, run in Ray workers (a plain module, not a conftest: the
Ray workers import it by name, and tests/distributed pickles its own conftest by name).

- `FsdpActorWorker`: a verl `Worker` holding an FSDP2 float32 model on CPU, with the two
  methods verl's `CheckpointEngineManager` calls on its actor worker group, written as
  verl's `ActorRolloutRefWorker` writes them (`verl/workers/engine_workers.py`): the
  checkpoint engine built from the `CheckpointEngineConfig` (custom_backend_module
  imported, `is_master` = global rank 0), and `update_weights` handing the checkpoint
  engine the per-tensor generator verl's FSDP engine makes (`state_dict()` then
  `full_tensor()` per parameter on every rank, `verl/workers/engine/fsdp/transformer_impl.py`).
- `ServeAdapter`: the rollout worker's server adapter, as verl's SGLang adapter loads
  weights (verl's own `get_named_tensor_buckets`, one `update_weights_from_tensor` per
  batch, each applied on arrival), into a `weightsync serve` (SGLang's API) instead of
  SGLang, which does not run here.
- `FaultyReceiver`: failure injection only: a transport receiver that corrupts or
  truncates one bucket, or kills its own process, installed on one rollout worker.
- `FakeReplica`: verl's `RolloutReplica` control verbs (abort, kv cache, resume) as
  no-ops; the engine is the `weightsync serve` above, which verl cannot start.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import torch
import torch.distributed as dist
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from weightsync.integrity import digest
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta
from weightsync.transports import make_receiver


def trainer_weights(model_dir: str, step: int) -> dict[str, torch.Tensor]:
    """The float32 weights the trainer holds after `step` (its checkpoint plus seeded noise):
    what every actor rank shards, and what the test computes its expected digests from."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = {}
    for index, (name, param) in enumerate(model.state_dict().items()):
        noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(1000 * step + index))
        out[name] = (param + 0.01 * step * noise).contiguous()
    return out


def bf16_digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """xxh3 of each tensor cast to the engine's bfloat16, as `weightsync serve` reports them."""
    return {name: digest(tensor.to(torch.bfloat16).contiguous()) for name, tensor in weights.items()}


class FsdpActorWorker(Worker):
    """One rank of verl's actor worker group: FSDP2 float32 model, verl's checkpoint engine."""

    def __init__(self, checkpoint_engine_config: Any, model_dir: str) -> None:
        super().__init__()
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        self.model_dir = model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self._done: asyncio.Event | None = None
        self._outcome: dict[str, Any] = {}
        # as ActorRolloutRefWorker.init_model builds it (engine_workers.py, "4. build checkpoint engine")
        config = checkpoint_engine_config
        backend = config.backend
        bucket_size = config.update_weights_bucket_megabytes << 20
        engine_kwargs = config.engine_kwargs.get(backend, {})
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, is_master=(dist.get_rank() == 0), bucket_size=bucket_size, **engine_kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_to(self, step: int) -> None:
        """Set the sharded weights to `trainer_weights(step)` (each rank its own shards)."""
        from torch.distributed.tensor import distribute_tensor

        weights = trainer_weights(self.model_dir, step)
        with torch.no_grad():
            for name, param in self.model.state_dict().items():
                param.copy_(distribute_tensor(weights[name], param.device_mesh, param.placements))

    def get_per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        """verl's FSDP engine's generator: every rank gathers every parameter whole, in order."""
        from torch.distributed.tensor import DTensor

        params = self.model.state_dict()
        return ((name, param.full_tensor() if isinstance(param, DTensor) else param) for name, param in params.items())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        """ActorRolloutRefWorker.update_weights for a checkpoint-engine backend, recording its outcome."""
        self._done = asyncio.Event()
        try:
            metrics = await self.checkpoint_engine.send_weights(self.get_per_tensor_param(), global_steps=global_steps)
            self._outcome = {"ok": True, "metrics": metrics}
            return metrics or {}
        except BaseException as e:
            self._outcome = {"ok": False, "error": type(e).__name__, "message": str(e)}
            raise
        finally:
            self._done.set()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def last_outcome(self) -> dict[str, Any]:
        """The outcome of the last `update_weights`, once it finished."""
        assert self._done is not None, "no update_weights yet"
        await self._done.wait()
        return self._outcome

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class ServeAdapter:
    """A rollout worker's server adapter over a `weightsync serve` (SGLang's API): batches
    as verl's SGLang adapter makes them, each loaded on arrival."""

    def __init__(self, url: str, *, bucket_bytes: int) -> None:
        self.url = url
        self.bucket_bytes = bucket_bytes
        self.replica_rank = 0
        self.is_leader_rank = True

    async def update_weights(self, weights: Any, global_steps: int | None = None,
                             wire_format: str = "named_tensors", **kwargs: Any) -> None:
        from verl.workers.rollout.sglang_rollout.utils import get_named_tensor_buckets

        assert wire_format == "named_tensors", wire_format
        async for batch in get_named_tensor_buckets(weights, self.bucket_bytes):
            payload = base64.b64encode(pickle.dumps([(name, t.clone()) for name, t in batch])).decode()
            body = {"serialized_named_tensors": [payload], "flush_cache": False,
                    "weight_version": str(global_steps)}
            answer = await asyncio.to_thread(httpx.post, f"{self.url}/update_weights_from_tensor", json=body,
                                             timeout=120)
            answer.raise_for_status()


class FaultyReceiver:
    """A transport receiver that damages bucket `index` on this rollout worker:
    "corrupt" flips a byte, "truncate" drops the last byte, "kill" SIGKILLs the process."""

    def __init__(self, transport: str, fault: str, index: int) -> None:
        assert fault in ("corrupt", "truncate", "kill"), fault
        self.transport = transport
        self.inner = make_receiver(transport, max_sessions=1)
        self.fault = fault
        self.index = index
        self.collective = self.inner.collective
        self.reads_at_commit = self.inner.reads_at_commit

    def __reduce__(self) -> tuple[Any, ...]:
        return FaultyReceiver, (self.transport, self.fault, self.index)

    def __getattr__(self, name: str) -> Any:  # join, leave, read, ...: the real receiver's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def fetch_hashed(self, link: Link, bucket: BucketMeta, delivery: Delivery, into: torch.Tensor,
                     algorithm: str) -> tuple[torch.Tensor, str | None]:
        if bucket.index == self.index and self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        data, computed = self.inner.fetch_hashed(link, bucket, delivery, into, algorithm)
        if bucket.index != self.index:
            return data, computed
        if self.fault == "corrupt":
            data[len(data) // 2] ^= 0xFF
            return data, None  # hashed on arrival, as if the bytes had been damaged on the wire
        return data[:-1], None


class FakeReplica:
    """verl's RolloutReplica as CheckpointEngineManager uses it: its workers, and control
    verbs for a vLLM/SGLang server (no-ops: the engine here is a `weightsync serve`)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def resume_generation(self) -> None:
        return None
