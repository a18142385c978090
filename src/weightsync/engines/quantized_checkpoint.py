"""What a quantized checkpoint directory declares (`formats.quantized.Quantization`): its
`quantization_config` (config.json) and, from its safetensors headers, which weights carry a
scale. For engines that cannot say it themselves (a stock SGLang started with `--quantization`)."""

from __future__ import annotations

import json
from pathlib import Path

from weightsync.formats.quantized import Quantization, format_from_config, quantized_weights
from weightsync.formats.version_dir import read_checkpoint_metas


def read_quantization(directory: str | Path) -> Quantization | None:
    """The quantization of the checkpoint at `directory` (None: it declares none). Raises
    FileNotFoundError without config.json and CastError for a format weightsync cannot produce."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    fmt = format_from_config(config.get("quantization_config"))
    if fmt is None:
        return None
    return Quantization(format=fmt, scales=quantized_weights(read_checkpoint_metas(directory), fmt))


__all__ = ["read_quantization"]
