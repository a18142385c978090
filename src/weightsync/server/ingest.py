"""Turning what each update route carries into `(name, tensor)` pairs.

Serialized tensors (base64 pickles, allow-listed unpickling), SGLang flattened
buckets, broadcasts from a weight-update group, Hugging Face safetensors
directories and PEFT adapter directories. Everything returned is a CPU tensor
whose shape can be trusted not to exceed its storage; nothing here touches
the served model, and nothing is copied that a later check could refuse
(callers validate names and shapes, then copy into staging).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from weightsync.dtypes import dtype_from_name
from weightsync.errors import ManifestError
from weightsync.formats.groups import UpdateGroup
from weightsync.manifest import TensorEntry
from weightsync.server.unpickle import LocalSerializedTensor, safe_loads

NamedTensors = list[tuple[str, torch.Tensor]]
MAX_ADAPTER_CONFIG_BYTES = 1 << 20


def check_tensor(name: Any, tensor: Any) -> tuple[str, torch.Tensor]:
    """A received pair must be (str, CPU tensor) whose view stays inside its storage; a
    tensor wrapped in SGLang's LocalSerializedTensor (verl) is this rank's (rank 0's)."""
    if isinstance(tensor, LocalSerializedTensor):
        tensor = tensor.unwrap(0)
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor name must be a non-empty string, got {name!r:.80}")
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name!r}: expected a tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
        raise ValueError(f"{name!r}: only dense CPU tensors are accepted")
    needed = _span_bytes(tensor)
    if needed > tensor.untyped_storage().nbytes():
        raise ValueError(f"{name!r}: shape {tuple(tensor.shape)} reaches past its storage")
    return name, tensor


def _span_bytes(tensor: torch.Tensor) -> int:
    """Bytes from the storage start to the end of the last element the view can reach."""
    if tensor.numel() == 0:
        return 0
    if any(s < 0 for s in tensor.stride()):
        return 1 << 62
    last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return int((last + 1) * tensor.element_size())


def decode_serialized(serialized: Any, load_format: str | None) -> NamedTensors:
    """`serialized_named_tensors` (one base64 pickle per TP rank; this server has one)."""
    if isinstance(serialized, str):
        serialized = [serialized]
    if not isinstance(serialized, list) or not serialized:
        raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings")
    if len(serialized) != 1:
        raise ValueError(f"serialized_named_tensors has {len(serialized)} entries; this server has tp_size 1")
    entry = serialized[0]
    if not isinstance(entry, str):
        raise ValueError("serialized_named_tensors entries must be base64 strings")
    try:
        raw = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"serialized_named_tensors[0] is not valid base64: {e}") from None
    obj = safe_loads(raw, what="serialized_named_tensors[0] pickle")
    if load_format == "flattened_bucket":
        return unflatten(obj)
    if load_format not in (None, "direct"):
        raise ValueError(f"unknown load_format {load_format!r}; use null or 'flattened_bucket'")
    if isinstance(obj, Mapping):
        obj = list(obj.items())
    if not isinstance(obj, list | tuple):
        raise ValueError(f"expected a pickled list of (name, tensor) pairs, got {type(obj).__name__}")
    pairs = []
    for item in obj:
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise ValueError("expected a pickled list of (name, tensor) pairs")
        pairs.append(check_tensor(item[0], item[1]))
    return pairs


def unflatten(obj: Any) -> NamedTensors:
    """SGLang's flattened bucket {"flattened_tensor", "metadata"} -> views, checked in bounds.

    A uint8 buffer takes byte offsets (multi-dtype buckets); a typed buffer takes
    element offsets of its own dtype (older single-dtype buckets).
    """
    if not isinstance(obj, Mapping) or "flattened_tensor" not in obj or "metadata" not in obj:
        raise ValueError("a flattened bucket must be a dict with 'flattened_tensor' and 'metadata'")
    _, flat = check_tensor("flattened_tensor", obj["flattened_tensor"])
    if flat.dim() != 1:
        raise ValueError(f"flattened_tensor must be 1-d, got shape {tuple(flat.shape)}")
    flat = flat.contiguous()
    metadata = obj["metadata"]
    if not isinstance(metadata, list | tuple):
        raise ValueError("flattened bucket metadata must be a list")
    pairs = []
    for meta in metadata:
        name, shape, dtype, start, end = _meta_fields(meta)
        numel = 1
        for d in shape:
            numel *= d
        if flat.dtype == torch.uint8:
            if start % dtype.itemsize:
                raise ValueError(f"{name!r}: byte offset {start} is not a multiple of its itemsize {dtype.itemsize}")
            want = numel * dtype.itemsize
        else:
            if dtype != flat.dtype:
                raise ValueError(f"{name!r}: dtype {dtype} differs from the flattened tensor's {flat.dtype}")
            want = numel
        if end - start != want or not 0 <= start <= end <= flat.numel():
            raise ValueError(
                f"{name!r}: span [{start}, {end}) does not hold shape {shape} in a buffer of {flat.numel()}"
            )
        piece = flat[start:end]
        pairs.append((name, (piece.view(dtype) if flat.dtype == torch.uint8 else piece).reshape(shape)))
    return pairs


def _meta_fields(meta: Any) -> tuple[str, tuple[int, ...], torch.dtype, int, int]:
    get = meta.get if isinstance(meta, Mapping) else (lambda k: getattr(meta, k, None))
    name, shape, dtype, start, end = (get(k) for k in ("name", "shape", "dtype", "start_idx", "end_idx"))
    if not isinstance(name, str):
        raise ValueError(f"flattened bucket metadata entry without a name: {meta!r:.80}")
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r}: metadata dtype must be a torch dtype")
    if not isinstance(shape, list | tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"{name!r}: metadata shape must be a list of non-negative ints")
    if not isinstance(start, int) or not isinstance(end, int):
        raise ValueError(f"{name!r}: metadata start_idx/end_idx must be integers")
    return name, tuple(shape), dtype, start, end


def parse_broadcast_spec(names: Any, dtypes: Any, shapes: Any) -> list[TensorEntry]:
    """The listed tensors of `/update_weights_from_distributed`, back to back from offset 0."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("names, dtypes and shapes must be lists")
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names, dtypes and shapes must be non-empty and of equal length "
                         f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    entries = []
    offset = 0
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str) or not isinstance(dtype_name, str):
            raise ValueError(f"names and dtypes must be strings, got {name!r} / {dtype_name!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{name!r}: shape must be a list of non-negative ints, got {shape!r}")
        try:
            entry = TensorEntry(hf_name=name, dtype=dtype_from_name(dtype_name), shape=tuple(shape), offset=offset)
        except ManifestError as e:
            raise ValueError(f"{name!r}: {e}") from None
        entries.append(entry)
        offset += entry.nbytes
    return entries


def receive_broadcast(group: UpdateGroup, entries: Sequence[TensorEntry], *, flattened: bool,
                      timeout_s: float, alloc: Callable[[int], torch.Tensor] | None = None,
                      ) -> tuple[NamedTensors, torch.Tensor | None]:
    """Receive the listed tensors from rank 0: one broadcast each, or one uint8 bucket.

    Flattened: refuses (before receiving) a tensor whose offset is not a
    multiple of its itemsize, as SGLang does. Returns freshly allocated tensors
    (and the bucket buffer when flattened, from `alloc(nbytes)` when given).
    """
    if flattened:
        for e in entries:
            if e.offset % e.dtype.itemsize:
                raise ValueError(f"{e.hf_name!r}: byte offset {e.offset} in the flattened bucket is not a "
                                 f"multiple of its itemsize {e.dtype.itemsize}; order tensors by descending itemsize")
        nbytes = sum(e.nbytes for e in entries)
        buffer = alloc(nbytes) if alloc is not None else torch.empty(nbytes, dtype=torch.uint8)
        group.broadcast(buffer, src=0, timeout_s=timeout_s)
        return [
            (e.hf_name, buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)) for e in entries
        ], buffer
    out = []
    for e in entries:
        tensor = torch.empty(e.shape, dtype=e.dtype)
        group.broadcast(tensor, src=0, timeout_s=timeout_s)
        out.append((e.hf_name, tensor))
    return out, None


def read_hf_checkpoint(directory: Path) -> NamedTensors:
    """Every tensor of a Hugging Face safetensors checkpoint directory (never pickles)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in directory.glob("*.bin"))
        hint = f" (found {pickled}: pickled checkpoints are refused, convert to safetensors)" if pickled else ""
        raise FileNotFoundError(f"{directory} holds no manifest.json and no *.safetensors files{hint}")
    pairs: NamedTensors = []
    seen: set[str] = set()
    for path in files:
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path.name}: not a readable safetensors file: {e}") from None
        for name, tensor in tensors.items():
            if name in seen:
                raise ValueError(f"{name!r} appears in more than one file of {directory}")
            seen.add(name)
            pairs.append((name, tensor))
    return pairs


def read_peft_dir(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """adapter_config.json and adapter_model.safetensors of a PEFT adapter directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_path = directory / "adapter_config.json"
    weights_path = directory / "adapter_model.safetensors"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} is not a PEFT adapter directory: no adapter_config.json")
    if not weights_path.is_file():
        hint = " (adapter_model.bin is a pickle and is refused)" if (directory / "adapter_model.bin").exists() else ""
        raise FileNotFoundError(f"{directory} has no adapter_model.safetensors{hint}")
    if config_path.stat().st_size > MAX_ADAPTER_CONFIG_BYTES:
        raise ValueError(f"{config_path} is larger than {MAX_ADAPTER_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_path.read_text())
        tensors = load_file(str(weights_path))
    except (ValueError, SafetensorError) as e:
        raise ValueError(f"{directory}: unreadable adapter: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object")
    return config, tensors


def sha256_hex(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (its dtype, C order), as `expected_checksums` carries."""
    data = tensor.detach().contiguous()
    if data.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    return hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
