"""CUDA IPC slots for the shm transport: where trainer and engine share a GPU, the trainer's
bucket slots live in one CUDA buffer, exported once (`torch.multiprocessing.reductions.reduce_tensor`)
and mapped by the engine (`CudaSlots.open`), which hashes each slot on the device.

The handle crosses processes as plain JSON (`encode_handle`), never pickled; the engine rebuilds the
tensor itself with torch's `rebuild_cuda_tensor` and allow-listed classes, and refuses a handle made on
another host or for a GPU it does not have (naming both UUIDs). Not yet run on a GPU (docs/LIMITS.md).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.owners import owner_tag
from weightsync.transports.shmem import slot_view

FORMAT = "weightsync-cuda-ipc/1"
_STORAGE_CLASSES: dict[str, Any] = {"TypedStorage": torch.storage.TypedStorage,
                                    "UntypedStorage": torch.UntypedStorage}
"""The only storage classes a handle may name (what torch's `reduce_tensor` gives)."""


def host_id() -> str:
    """This host (and pid namespace), as `owners.owner_tag` names it."""
    return owner_tag().partition("-")[0]


def gpu_uuid(device: torch.device | int) -> str:
    """The physical GPU's UUID (stable across CUDA_VISIBLE_DEVICES renumbering)."""
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass(frozen=True)
class IpcHandle:
    """What an engine needs to map the trainer's CUDA slots: the fields of torch's
    `reduce_tensor` for one 1-d uint8 CUDA tensor, plus where it was made."""

    host: str
    gpu_uuid: str
    nbytes: int
    storage_class: str
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    tensor_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


def export_slots(buffer: torch.Tensor) -> IpcHandle:
    """Export `buffer` (1-d uint8, contiguous, on a CUDA device) once; the caller keeps it
    alive for as long as engines map it."""
    if not buffer.is_cuda or buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"CUDA IPC exports a contiguous 1-d uint8 CUDA buffer, not {buffer.dtype} "
                         f"{tuple(buffer.shape)} on {buffer.device}")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    (_cls, _size, _stride, tensor_offset, storage_cls, _dtype, _device, storage_handle, storage_size_bytes,
     storage_offset_bytes, _grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
    return IpcHandle(host=host_id(), gpu_uuid=gpu_uuid(buffer.device), nbytes=buffer.numel(),
                     storage_class=storage_cls.__name__, storage_handle=bytes(storage_handle),
                     storage_size_bytes=int(storage_size_bytes), storage_offset_bytes=int(storage_offset_bytes),
                     tensor_offset=int(tensor_offset), ref_counter_handle=bytes(ref_counter_handle),
                     ref_counter_offset=int(ref_counter_offset),
                     event_handle=None if event_handle is None else bytes(event_handle),
                     event_sync_required=bool(event_sync_required))


def encode_handle(handle: IpcHandle) -> str:
    """The handle as JSON text (bytes as base64): what a link carries."""
    fields = {k: (base64.b64encode(v).decode() if isinstance(v, bytes) else v) for k, v in handle.__dict__.items()}
    return json.dumps({"format": FORMAT, **fields}, separators=(",", ":"), sort_keys=True)


def decode_handle(text: str) -> IpcHandle:
    """`encode_handle`'s text back; ValueError naming what is wrong for anything else."""
    try:
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} handle")
        if d["storage_class"] not in _STORAGE_CLASSES:
            raise ValueError(f"storage class {d['storage_class']!r} is not one of {sorted(_STORAGE_CLASSES)}")

        def raw(key: str) -> bytes:
            return base64.b64decode(d[key], validate=True)

        handle = IpcHandle(
            host=str(d["host"]), gpu_uuid=str(d["gpu_uuid"]), nbytes=int(d["nbytes"]),
            storage_class=str(d["storage_class"]), storage_handle=raw("storage_handle"),
            storage_size_bytes=int(d["storage_size_bytes"]), storage_offset_bytes=int(d["storage_offset_bytes"]),
            tensor_offset=int(d["tensor_offset"]), ref_counter_handle=raw("ref_counter_handle"),
            ref_counter_offset=int(d["ref_counter_offset"]),
            event_handle=None if d["event_handle"] is None else raw("event_handle"),
            event_sync_required=bool(d["event_sync_required"]))
    except (KeyError, TypeError, json.JSONDecodeError, binascii.Error) as e:
        raise ValueError(f"malformed CUDA IPC handle: {type(e).__name__}: {e}") from None
    size = handle.storage_size_bytes
    if handle.nbytes < 0 or handle.tensor_offset < 0 or handle.nbytes + handle.tensor_offset > size:
        raise ValueError(f"CUDA IPC handle: {handle.nbytes} bytes at offset {handle.tensor_offset} do not fit its "
                         f"{handle.storage_size_bytes}-byte storage")
    return handle


def check_local(handle: IpcHandle, device: torch.device | None = None) -> int:
    """The index of this process's CUDA device that holds `handle`'s memory; ValueError when
    the handle was made on another host, or for a GPU this process does not have (or not
    `device`, when given), naming both UUIDs."""
    here = host_id()
    if handle.host != here:
        raise ValueError(f"a CUDA IPC handle made on host {handle.host} reached host {here}: CUDA IPC maps memory "
                         "on the host that exported it only; use the shm transport without cuda_ipc, or broadcast")
    if not torch.cuda.is_available():
        raise ValueError(f"the trainer's slots are on GPU {handle.gpu_uuid}; this engine process has no CUDA device: "
                         "use the shm transport without cuda_ipc")
    indices = [torch.device(device).index or 0] if device is not None else range(torch.cuda.device_count())
    uuids = {i: gpu_uuid(i) for i in indices}
    for index, uuid in uuids.items():
        if uuid == handle.gpu_uuid:
            return index
    raise ValueError(mismatch_message(handle.gpu_uuid, list(uuids.values())))


def mismatch_message(trainer_uuid: str, engine_uuids: list[str]) -> str:
    engines = ", ".join(engine_uuids) or "none"
    return (f"the trainer's slots are on GPU {trainer_uuid}, this engine is on GPU {engines}: "
            "CUDA IPC maps memory of the same GPU only; use the shm transport without cuda_ipc (host slots), "
            "or broadcast")


class CudaSlots:
    """The trainer's CUDA slots as an engine maps them: `num_slots` slots of `slot_bytes`."""

    def __init__(self, tensor: torch.Tensor, *, slot_bytes: int, num_slots: int) -> None:
        if tensor.numel() < slot_bytes * num_slots:
            raise ValueError(f"the mapped CUDA buffer has {tensor.numel()} bytes, the link says "
                             f"{num_slots} slots of {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._tensor: torch.Tensor | None = tensor

    @classmethod
    def open(cls, text: str, *, slot_bytes: int, num_slots: int, device: torch.device | None = None) -> CudaSlots:
        handle = decode_handle(text)
        index = check_local(handle, device)
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        tensor = rebuild_cuda_tensor(
            torch.Tensor, torch.Size([handle.nbytes]), (1,), handle.tensor_offset,
            _STORAGE_CLASSES[handle.storage_class], torch.uint8, index, handle.storage_handle,
            handle.storage_size_bytes, handle.storage_offset_bytes, False, handle.ref_counter_handle,
            handle.ref_counter_offset, handle.event_handle, handle.event_sync_required)
        return cls(tensor, slot_bytes=slot_bytes, num_slots=num_slots)

    def slot(self, index: int, nbytes: int | None = None) -> torch.Tensor:
        assert self._tensor is not None, "closed"
        return slot_view(self._tensor, index, nbytes, slot_bytes=self.slot_bytes, num_slots=self.num_slots)

    def close(self) -> None:
        self._tensor = None
