"""The allow-listed unpickler: CPU tensors in any form `pickle.dumps` writes them
round-trip; every other global is refused by name, before it can run."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
from collections import OrderedDict
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync.server.ingest import check_tensor
from weightsync.server.unpickle import (
    AllowListUnpickler,
    UnsafePickleError,
    load_storage_bytes,
    safe_loads,
)

AWKWARD = [
    torch.tensor(1.5, dtype=torch.bfloat16),  # 0-d bf16
    torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:],  # non-contiguous view
    torch.zeros(0, 5),  # empty
    torch.randn(4, 4, dtype=torch.float16),
    torch.tensor([True, False]),
    torch.arange(5, dtype=torch.int64),
]


@pytest.mark.parametrize("tensor", AWKWARD, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_tensors_round_trip(tensor: torch.Tensor) -> None:
    got = safe_loads(pickle.dumps([("w", tensor)]))
    assert got[0][0] == "w"
    assert got[0][1].dtype == tensor.dtype and torch.equal(got[0][1], tensor)


def test_containers_and_parameters() -> None:
    obj = {"a": torch.nn.Parameter(torch.ones(2)), "b": OrderedDict(x=torch.zeros(1)), "c": (1, 2.0, "s", None)}
    got = safe_loads(pickle.dumps(obj, protocol=3))
    assert torch.equal(got["a"], torch.ones(2)) and torch.equal(got["b"]["x"], torch.zeros(1))
    assert got["c"] == (1, 2.0, "s", None)


def test_is_a_pickle_unpickler() -> None:
    assert issubclass(AllowListUnpickler, pickle.Unpickler)


class _Reduces:
    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> Any:
        return self.func, self.args


@pytest.mark.parametrize("protocol", [0, 2, 3, 4, 5])
@pytest.mark.parametrize(("func", "args", "needle"), [
    (os.system, ("true",), "system"),
    (subprocess.Popen, (["true"],), "subprocess.Popen"),
    (eval, ("1",), "builtins.eval"),
    (exec, ("x = 1",), "builtins.exec"),
    (getattr, ("x", "upper"), "builtins.getattr"),
    (__import__, ("os",), "builtins.__import__"),
    (torch.load, ("/dev/null",), "torch.serialization.load"),
])
def test_dangerous_globals_are_refused_by_name(protocol: int, func: Any, args: Any, needle: str,
                                               tmp_path: Path) -> None:
    data = pickle.dumps([("w", _Reduces(func, *args))], protocol=protocol)
    with pytest.raises(UnsafePickleError, match="refused global") as info:
        safe_loads(data)
    assert needle in str(info.value)


def test_torch_shared_memory_rebuilds_are_refused() -> None:
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([("w", torch.ones(3))])
    with pytest.raises(UnsafePickleError, match="torch.multiprocessing.reductions"):
        safe_loads(buffer.getvalue())


@pytest.mark.parametrize("data", [b"", b"garbage", pickle.dumps(torch.ones(100))[:-30], b"\x80\x04\x95"])
def test_malformed_pickles_are_refused(data: bytes) -> None:
    with pytest.raises(UnsafePickleError):
        safe_loads(data)


def _storage_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes `pickle.dumps(tensor)` hands to torch.storage._load_from_bytes."""
    captured: list[bytes] = []

    class Capture(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if name == "_load_from_bytes":
                return lambda b: captured.append(b)
            return super().find_class(module, name)

    with pytest.raises(Exception):  # noqa: B017 (the tensor cannot be rebuilt from None)
        Capture(io.BytesIO(pickle.dumps(tensor))).load()
    return captured[0]


def test_storage_parser_reads_torch_legacy_format() -> None:
    tensor = torch.arange(6, dtype=torch.float32)
    storage = load_storage_bytes(_storage_bytes(tensor))
    assert storage.dtype == torch.float32 and storage.size() == 6
    with pytest.raises(UnsafePickleError, match="truncated"):
        load_storage_bytes(_storage_bytes(tensor)[:-4])


def test_storage_header_cannot_name_other_globals() -> None:
    raw = _storage_bytes(torch.ones(2))
    tampered = raw.replace(b"torch\nFloatStorage", b"posix\nsystem\n\x00\x00\x00\x00\x00")
    with pytest.raises(UnsafePickleError):
        load_storage_bytes(tampered)


def test_received_pairs_must_be_names_and_cpu_tensors() -> None:
    assert check_tensor("ok", torch.ones(4)[1:])[0] == "ok"
    with pytest.raises(ValueError, match="name"):
        check_tensor(3, torch.ones(1))
    with pytest.raises(ValueError, match="expected a tensor"):
        check_tensor("w", [1.0])
    with pytest.raises(ValueError, match="dense CPU"):
        check_tensor("w", torch.ones(2).to_sparse())


class _OutOfBounds:
    """Pickles as a tensor claiming 64 elements of a 4-element storage."""

    def __reduce__(self) -> Any:
        from torch._utils import _rebuild_tensor_v2

        return _rebuild_tensor_v2, (torch.ones(4).storage(), 0, (64,), (1,), False,
                                    OrderedDict())


def test_out_of_bounds_views_in_a_pickle_are_refused() -> None:
    # torch itself would grow the storage to 64 elements; the server refuses instead.
    with pytest.raises(UnsafePickleError, match="reaches element 63 of a 4-element storage"):
        safe_loads(pickle.dumps(_OutOfBounds()))


class _VerlWrapped:
    """Pickles as SGLang's LocalSerializedTensor (a dataclass with `values`, one
    serialized tensor per TP rank), as verl's SGLang rollout sends it."""

    def __init__(self, values: list[Any]) -> None:
        self.values = values


_VerlWrapped.__module__ = "sglang.srt.model_executor.model_runner_components.weight_updater"
_VerlWrapped.__qualname__ = "LocalSerializedTensor"


def _pickled_as(module: str, obj: Any) -> bytes:
    _VerlWrapped.__module__ = module
    try:
        import sys
        import types

        parts = module.split(".")
        names = [".".join(parts[: i + 1]) for i in range(len(parts))]
        saved = {n: sys.modules.get(n) for n in names}
        for n in names:
            sys.modules[n] = types.ModuleType(n)
        sys.modules[module].LocalSerializedTensor = _VerlWrapped  # type: ignore[attr-defined]
        try:
            return pickle.dumps(obj)
        finally:
            for n, old in saved.items():
                if old is None:
                    del sys.modules[n]
                else:
                    sys.modules[n] = old
    finally:
        _VerlWrapped.__module__ = "sglang.srt.model_executor.model_runner_components.weight_updater"


@pytest.mark.parametrize("module", ["sglang.srt.model_executor.model_runner_components.weight_updater",
                                    "sglang.srt.model_executor.model_runner"])
def test_local_serialized_tensor_unwraps_rank_0(module: str) -> None:
    from weightsync.server.ingest import decode_serialized

    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    raw = _pickled_as(module, [("w", _VerlWrapped([pickle.dumps(tensor)]))])
    import base64

    [(name, got)] = decode_serialized([base64.b64encode(raw).decode()], None)
    assert name == "w" and torch.equal(got, tensor)


def test_local_serialized_tensor_payloads_stay_allow_listed() -> None:
    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("true",))

    module = "sglang.srt.model_executor.model_runner_components.weight_updater"
    inner_evil = safe_loads(_pickled_as(module, _VerlWrapped([pickle.dumps(Evil())])))
    with pytest.raises(UnsafePickleError, match="refused global posix.system"):
        check_tensor("w", inner_evil)
    # A class of the same name elsewhere in sglang is not allowed (SGLang allows two names only).
    with pytest.raises(UnsafePickleError, match="refused global sglang.srt.utils.common.LocalSerializedTensor"):
        safe_loads(_pickled_as("sglang.srt.utils.common", _VerlWrapped([pickle.dumps(torch.zeros(1))])))
    # State beyond `values` is refused, and so is a wrapper of a wrapper.
    odd = _VerlWrapped([pickle.dumps(torch.zeros(1))])
    odd.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(UnsafePickleError, match="only 'values'"):
        safe_loads(_pickled_as(module, odd))
    nested = safe_loads(_pickled_as(module, _VerlWrapped([_pickled_as(module, _VerlWrapped([b""]))])))
    with pytest.raises(ValueError, match="expected a tensor"):
        check_tensor("w", nested)
    # SGLang's MultiprocessingSerializer (ForkingPickler) inside: refused, naming why.
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(torch.zeros(4))
    shared = safe_loads(_pickled_as(module, _VerlWrapped([buffer.getvalue()])))
    with pytest.raises(UnsafePickleError, match="MultiprocessingSerializer"):
        check_tensor("w", shared)
