"""weightsync's vLLM plugin: registers the `"weightsync"` weight-transfer backend.

Declared in pyproject.toml as a `vllm.general_plugins` entry point, so an
installed weightsync is found by vLLM's `load_general_plugins()`, which runs
`register` in every vLLM process (the frontend, the engine core, every worker)
before the model loads; `VLLM_PLUGINS` (a comma-separated allow-list of plugin
names) can leave it out. Registering in the trainer's process alone is not
enough: the workers would refuse the backend ("Invalid weight transfer backend").

`register` is idempotent (vLLM's `register_engine` raises for a name taken, and
plugins may run more than once per process) and imports no engine code: vLLM's
factories import `engines.vllm.transfer_engine` (worker side) and
`engines.vllm.transfer_trainer` (trainer side) only when the backend is used.
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
