"""LoRA on the trainer side: the merge math (pure) and the PEFT directory export.

The streams themselves ("lora", "lora-merged") are `sources.peft.LoraSource`
and `MergedLoraSource`. Importing this package does not import peft.
"""

from weightsync.lora.export import CONFIG_NAME, WEIGHTS_NAME, adapter_config, export_lora_adapter
from weightsync.lora.merge import (
    embedding_delta,
    linear_delta,
    lora_scaling,
    merge_bias,
    merge_embedding,
    merge_linear,
    merge_weight,
)

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "adapter_config",
    "embedding_delta",
    "export_lora_adapter",
    "linear_delta",
    "lora_scaling",
    "merge_bias",
    "merge_embedding",
    "merge_linear",
    "merge_weight",
]
