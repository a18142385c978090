"""An allow-listed unpickler for the tensors SGLang-shaped routes carry.

`/update_weights_from_tensor` and `/load_lora_adapter_from_tensors` receive pickles, which
`server/ingest.py` hands to `safe_loads`: nothing is unpickled unless every global it names is on an
explicit list, and anything else (`os.system`, torch's shared-memory rebuild functions ...) is
refused naming the global. Pure: bytes in, Python objects and CPU tensors out; no I/O. The list, and
what replaces `torch.storage._load_from_bytes`: docs/ARCHITECTURE.md, "Design notes, by module".
"""

from __future__ import annotations

import builtins
import collections
import io
import pickle
import struct
from typing import Any

import torch

from weightsync.errors import WeightSyncError

# torch's legacy serialization header (torch.serialization.MAGIC_NUMBER / PROTOCOL_VERSION).
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}
_DTYPE_NAMES = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
    "uint8", "bool", "complex64", "complex128",
)
_BUILTIN_CONTAINERS = ("list", "tuple", "dict", "set", "frozenset", "bytearray", "bytes", "str",
                       "int", "float", "bool", "complex")


class UnsafePickleError(WeightSyncError, ValueError):
    """A pickle named a global that is not allow-listed, or is malformed."""


class FlattenedTensorMetadata:
    """Stand-in for `sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`.

    Holds only plain attributes (name, shape, dtype, start_idx, end_idx, numel);
    unpickling sets them from the pickled state dict and runs no code.
    """

    name: Any = None
    shape: Any = None
    dtype: Any = None
    start_idx: Any = None
    end_idx: Any = None
    numel: Any = None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) form
            state = state[0] or state[1]
        if not isinstance(state, dict):
            raise UnsafePickleError("FlattenedTensorMetadata state must be a dict")
        for key in ("name", "shape", "dtype", "start_idx", "end_idx", "numel"):
            setattr(self, key, state.get(key))


class LocalSerializedTensor:
    """Stand-in for SGLang's `LocalSerializedTensor` (verl wraps each tensor of
    `/update_weights_from_tensor` in one): `values` holds one serialized tensor per TP
    rank, each unpickled later with this same allow-list (`unwrap`). Unpickling sets
    `values` from the pickled state dict and runs no code."""

    values: Any = None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) form
            state = state[0] or state[1]
        if not isinstance(state, dict) or set(state) != {"values"}:
            raise UnsafePickleError("LocalSerializedTensor state must be a dict holding only 'values'")
        self.values = state["values"]

    def unwrap(self, rank: int = 0) -> Any:
        """The tensor serialized for `rank` (SGLang's `LocalSerializedTensor.get`)."""
        values = self.values
        if not isinstance(values, list) or not values or not all(isinstance(v, bytes | str) for v in values):
            raise UnsafePickleError("LocalSerializedTensor.values must be a non-empty list of serialized tensors")
        if rank >= len(values):
            raise UnsafePickleError(f"LocalSerializedTensor has {len(values)} value(s), none for TP rank {rank}")
        value = values[rank]
        if isinstance(value, str):  # MultiprocessingSerializer's output_str form
            import base64
            import binascii

            try:
                value = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as e:
                raise UnsafePickleError(f"LocalSerializedTensor.values[{rank}] is not valid base64: {e}") from None
        return safe_loads(value, what=f"LocalSerializedTensor.values[{rank}]")


class _StorageHeaderUnpickler(pickle.Unpickler):
    """Reads the pickled part of torch's legacy storage format.

    Only storage classes may be named; a storage is returned as its
    persistent-id record, filled with bytes afterwards by `load_storage_bytes`.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _STORAGE_DTYPES:
            return ("storage-class", name)
        raise UnsafePickleError(f"refused global {module}.{name} inside a pickled tensor storage")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            raise UnsafePickleError(f"unexpected persistent id {pid!r:.80} in a pickled tensor storage")
        _, storage_class, key, location, numel, view_metadata = pid
        if not (isinstance(storage_class, tuple) and storage_class[0] == "storage-class"):
            raise UnsafePickleError("pickled tensor storage without a storage class")
        if location != "cpu" or view_metadata is not None:
            raise UnsafePickleError(f"only plain CPU storages are accepted, got location {location!r}")
        if not isinstance(key, str) or not isinstance(numel, int) or numel < 0:
            raise UnsafePickleError("malformed pickled tensor storage record")
        return ("storage-ref", key, _STORAGE_DTYPES[storage_class[1]], numel)


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only (ints, strings, lists, dicts)."""

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(f"refused global {module}.{name} inside a pickled tensor storage")


def load_storage_bytes(data: bytes) -> torch.storage.TypedStorage:
    """Safe replacement for `torch.storage._load_from_bytes` (legacy `torch.save` of one storage).

    Layout: pickled magic, protocol and sys_info; a pickle whose root is a
    persistent reference to the storage; a pickled list of storage keys; then
    per key an int64 element count and the raw little-endian bytes.
    """
    f = io.BytesIO(data)
    if _PlainUnpickler(f).load() != _LEGACY_MAGIC or _PlainUnpickler(f).load() != _LEGACY_PROTOCOL:
        raise UnsafePickleError("pickled tensor storage has an unknown header")
    sys_info = _PlainUnpickler(f).load()
    if not isinstance(sys_info, dict) or sys_info.get("little_endian") is not True:
        raise UnsafePickleError("only little-endian pickled tensor storages are accepted")
    root = _StorageHeaderUnpickler(f).load()
    keys = _PlainUnpickler(f).load()
    if not (isinstance(root, tuple) and root[0] == "storage-ref") or keys != [root[1]]:
        raise UnsafePickleError("a pickled tensor storage must hold exactly one storage")
    _, _, dtype, numel = root
    (count,) = struct.unpack("<q", f.read(8).ljust(8, b"\0"))
    nbytes = numel * dtype.itemsize
    raw = f.read(nbytes)
    if count != numel or len(raw) != nbytes:
        raise UnsafePickleError(f"pickled tensor storage is truncated: {len(raw)} of {nbytes} bytes")
    untyped = torch.UntypedStorage.from_buffer(raw, dtype=torch.uint8) if nbytes else torch.UntypedStorage(0)
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _check_view(storage: Any, storage_offset: Any, size: Any, stride: Any) -> None:
    """Refuse a view that reaches past its storage: torch's `set_` would silently GROW the
    storage to fit, so a forged size could make the server allocate without bound."""
    if not isinstance(storage, torch.storage.TypedStorage):
        raise UnsafePickleError(f"a pickled tensor must rebuild from a storage, got {type(storage).__name__}")
    dims = (storage_offset, *size, *stride)
    if len(size) != len(stride) or not all(isinstance(d, int) and d >= 0 for d in dims):
        raise UnsafePickleError("a pickled tensor has a malformed offset, size or stride")
    if any(n == 0 for n in size):
        return
    last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if (last + 1) > storage.size():
        raise UnsafePickleError(
            f"a pickled tensor of size {tuple(size)} reaches element {last} of a {storage.size()}-element storage"
        )


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, metadata: Any = None) -> torch.Tensor:
    from torch import _utils as torch_utils

    _check_view(storage, storage_offset, size, stride)
    return torch_utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
                                          backward_hooks, metadata)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> torch.Tensor:
    from torch import _utils as torch_utils

    _check_view(storage, storage_offset, size, stride)
    return torch_utils._rebuild_tensor(storage, storage_offset, size, stride)


def _allowed_globals() -> dict[tuple[str, str], Any]:
    from torch import _utils as torch_utils

    allowed: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): torch_utils._rebuild_parameter,
        ("torch.storage", "_load_from_bytes"): load_storage_bytes,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch", "Size"): torch.Size,
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
        ("weightsync.server.unpickle", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
        # SGLang's SafeUnpickler allows this class under both of its module names.
        ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"):
            LocalSerializedTensor,
        ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
    }
    for dtype_name in _DTYPE_NAMES:
        allowed[("torch", dtype_name)] = getattr(torch, dtype_name)
    for name in _BUILTIN_CONTAINERS:
        allowed[("builtins", name)] = getattr(builtins, name)
    return allowed


ALLOWED_GLOBALS: dict[tuple[str, str], Any] = _allowed_globals()
"""Every (module, name) a pickle may reference, and what it resolves to."""


class AllowListUnpickler(pickle.Unpickler):
    """A `pickle.Unpickler` that resolves only the globals in `ALLOWED_GLOBALS`.

    Python 2 names (protocols 0-2: `__builtin__.eval`) are mapped to their Python 3
    names first, so they are checked and reported under the names that run.
    """

    def find_class(self, module: str, name: str) -> Any:
        module, name = _py3_name(module, name)
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"refused global {module}.{name}: the pickle may only name CPU tensors "
                "(as pickle.dumps writes them), torch dtypes and builtin containers"
                + (_SHARED_MEMORY_HINT if module.startswith(_SHARED_MEMORY_MODULES) else "")
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"refused persistent id {pid!r:.80}")


_SHARED_MEMORY_MODULES = ("torch.multiprocessing", "multiprocessing.resource_sharer", "multiprocessing.reduction")
_SHARED_MEMORY_HINT = (
    "; this is a MultiprocessingSerializer (ForkingPickler) payload, which passes a shared-memory "
    "handle instead of the bytes: this server refuses those, serialize the tensors with pickle.dumps "
    "(or send them over /update_weights_from_distributed or weightsync's shm transport)"
)


def _py3_name(module: str, name: str) -> tuple[str, str]:
    import _compat_pickle

    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


# Exceptions a hostile or corrupt pickle can raise while loading, beyond ours.
_MALFORMED = (pickle.UnpicklingError, EOFError, ValueError, TypeError, RuntimeError, AttributeError,
              IndexError, KeyError, OverflowError, struct.error, RecursionError, MemoryError)


def safe_loads(data: bytes, *, what: str = "pickle") -> Any:
    """Unpickle `data` with the allow-list; raises UnsafePickleError naming the problem."""
    try:
        return AllowListUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError:
        raise
    except _MALFORMED as e:
        raise UnsafePickleError(f"malformed {what}: {type(e).__name__}: {e}") from None


def allowed_global_names() -> list[str]:
    """`module.name` of every allowed global, for error messages and docs."""
    return sorted(f"{m}.{n}" for m, n in ALLOWED_GLOBALS)


__all__: list[str] = [
    "ALLOWED_GLOBALS",
    "AllowListUnpickler",
    "FlattenedTensorMetadata",
    "LocalSerializedTensor",
    "UnsafePickleError",
    "allowed_global_names",
    "load_storage_bytes",
    "safe_loads",
]
