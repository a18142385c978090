"""weightsync's vLLM plugin (the `vllm.general_plugins` entry point `weightsync`): registers the `"weightsync"`
weight-transfer backend in every vLLM process.

It imports no engine code: vLLM's factories import `transfer_engine` (worker side) and
`transfer_trainer` (trainer side) only when the backend is used. docs/VLLM.md, "The plugin".
"""

from __future__ import annotations

BACKEND = "weightsync"
"""The backend name: `weight_transfer_config={"backend": "weightsync"}`."""
WORKER_ENGINE = ("weightsync.engines.vllm.transfer_engine", "WeightSyncTransferEngine")
TRAINER_ENGINE = ("weightsync.engines.vllm.transfer_trainer", "WeightSyncTrainerEngine")


def register() -> None:
    """Register the `"weightsync"` backend with vLLM's worker and trainer factories, once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, *WORKER_ENGINE)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, *TRAINER_ENGINE)


__all__ = ["BACKEND", "register"]
