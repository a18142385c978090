"""The dtypes weights are synced in, and their names on the wire: torch's attribute
names ("bfloat16"), which the manifest, weightsync's own requests and SGLang's all use.
Pure: no tensors, no I/O.
"""

from __future__ import annotations

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
