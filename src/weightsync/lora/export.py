"""A trainer's LoRA adapter written as a PEFT adapter directory (`adapter_model.safetensors`,
`adapter_config.json`), as `save_pretrained` writes it and PEFT, vLLM and SGLang load it.

Tensors come from `lora.source.LoraSource` (FSDP2: gathered one at a time, so every rank calls
`export_lora_adapter`; only ranks with `write=True` write). Files go under a temporary name and are
renamed into place, weights first. `lora.source` (peft, slow to import) is imported on call.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"


def adapter_config(peft_model: nn.Module, adapter_name: str | None = None) -> dict[str, Any]:
    """adapter_config.json content for `adapter_name` (default: the active adapter).

    The dict PEFT's `save_pretrained` writes, in JSON types (target_modules as
    a sorted list), with `inference_mode` true; `LoraConfig(**...)` and
    `PeftConfig.from_pretrained` accept it.
    """
    from weightsync.lora.source import adapter_config as _adapter_config

    return _adapter_config(peft_model, adapter_name)


def export_lora_adapter(
    peft_model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    adapter_name: str | None = None,
    write: bool = True,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write `peft_model`'s adapter to `out_dir` as a PEFT adapter directory; return its path.

    Works for plain, DDP, compiled and FSDP2-wrapped PEFT models. Under FSDP2
    this is a collective: call it on every rank; pass `write=False` on the
    ranks that should not write (typically `write=(rank == 0)`).
    `base_model_name_or_path` overrides the value recorded in the config.
    Refuses what `LoraSource` refuses (DoRA, other tuners, embedding targets).
    """
    from safetensors.torch import save_file

    from weightsync.lora.source import LoraSource

    source = LoraSource(peft_model, adapter_name=adapter_name)
    config = source.config()
    if base_model_name_or_path is not None:
        config["base_model_name_or_path"] = base_model_name_or_path
    tensors: dict[str, torch.Tensor] = {}
    for peft_name, tensor in source.tensors():  # FSDP2: a gather per tensor, on every rank
        if write:
            tensors[peft_name] = tensor.detach().to("cpu").contiguous()
    out = Path(out_dir)
    if not write:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tmp_weights = out / f".{WEIGHTS_NAME}.tmp"
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    os.replace(tmp_weights, out / WEIGHTS_NAME)
    tmp_config = out / f".{CONFIG_NAME}.tmp"
    tmp_config.write_text(json.dumps(config, indent=2, sort_keys=True))
    os.replace(tmp_config, out / CONFIG_NAME)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    logger.info(
        "exported LoRA adapter %r: %d tensors, %d bytes -> %s", source.adapter_name, len(tensors), num_bytes, out
    )
    return out
