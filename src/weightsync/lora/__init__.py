"""LoRA on the trainer side: the merge math (`merge`, pure), the streams read from a
PEFT model (`source`: `LoraSource` for "lora", `MergedLoraSource` for "lora-merged")
and the PEFT directory export (`export`).

Importing this package does not import peft; `lora.source` does, when a LoRA mode
or the export first needs it.
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
