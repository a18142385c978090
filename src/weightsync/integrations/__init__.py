"""weightsync inside the RL frameworks' own plug-in points.

- `weightsync.integrations.verl`: verl's checkpoint-engine backend `"weightsync"`
  (`actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync` and
  `custom_backend_module=weightsync.integrations.verl`).
- `weightsync.integrations.trl`: `WeightTransfer`, for TRL's
  `AsyncGRPOTrainer(..., weight_transfer=...)`.
- `weightsync.integrations.vllm_trainer`: vLLM's trainer API for the `"weightsync"`
  weight-transfer backend (`WeightSyncTrainerEngine`), which vLLM's trainer factory
  loads by name (`engines.vllm.plugin`).

Nothing in the library imports this package; each module imports its framework
(`pip install 'weightsync[integrations]'`, see docs/INTEGRATIONS.md).
"""
