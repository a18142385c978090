"""The dtypes weights are synced in, and their names on the wire: torch's attribute
names ("bfloat16"), which the manifest, weightsync's own requests and SGLang's all use;
and the dtype each tensor of a push travels in (`Cast`). Pure: no tensors, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.errors import ManifestError

# Every dtype the wire formats accept. Quantized dtypes are not weights we sync.
_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name in (
        "float64", "float32", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
        "float8_e8m0fnu", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64",
        "bool",
    )
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The torch attribute name of `dtype` ("bfloat16"), as SGLang expects it."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ManifestError(f"dtype {dtype} cannot be synced; supported: {sorted(_DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `dtype_name`; raises ManifestError for an unknown name."""
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ManifestError(f"unknown dtype {name!r}; supported: {sorted(_DTYPES)}") from None


def castable(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a tensor of dtype `src` may travel as `dst`: equal dtypes, or both
    floating point. Integer, bool and complex tensors are never cast."""
    return src == dst or (src.is_floating_point and dst.is_floating_point)


@dataclass(frozen=True)
class Cast:
    """The dtype each floating tensor of a push travels in: `to`, the dtype the engines
    serve, except the tensors they keep in another dtype (`kept`). A bfloat16 GLM-4.5 or
    DeepSeek-V3 keeps its routers' `e_score_correction_bias` (and vLLM its router weights)
    in float32: a float32 master's values reach those exactly. Integer, bool and complex
    tensors always travel as they are held."""

    to: torch.dtype | None = None
    """The engines' dtype for floating tensors (None: as the trainer holds them)."""
    kept: Mapping[str, torch.dtype] = field(default_factory=dict)
    """Checkpoint name (the trainer's `hf_name`) -> the dtype the engines hold it in, where
    that is not `to` (`EngineCapabilities.kept_dtypes`)."""

    def of(self, hf_name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype tensor `hf_name`, held in `dtype`, travels in."""
        target = self.kept.get(hf_name, self.to) if self.kept else self.to
        return target if target is not None and castable(dtype, target) else dtype

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the trainer's other ranks are told (`modes.base.Planner.share_step`)."""
        return {"to": None if self.to is None else dtype_name(self.to),
                "kept": {name: dtype_name(d) for name, d in self.kept.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Cast:
        """Parse `to_dict`'s form (None: no cast)."""
        if not d:
            return cls()
        to = d.get("to")
        return cls(to=dtype_from_name(str(to)) if to else None,
                   kept={str(n): dtype_from_name(str(v)) for n, v in (d.get("kept") or {}).items()})
