"""CUDA IPC for the shm transport (`transports.cuda_ipc`), the parts that need no GPU: the
handle's JSON encoding and its refusals (no pickle: unknown classes and malformed fields are
errors), a handle from another host refused, a GPU mismatch refused naming both UUIDs, the
link carrying the handle. The mapping itself: tests/gpu/test_cuda_ipc.py (where CUDA is present)."""

from __future__ import annotations

import json

import pytest
import torch

from weightsync.links import Link
from weightsync.transports.cuda_ipc import (
    IpcHandle,
    check_local,
    decode_handle,
    encode_handle,
    host_id,
    mismatch_message,
)
from weightsync.transports.shm import ShmLink, ShmReceiver, ShmTransport

TRAINER_UUID = "GPU-11111111-2222-3333-4444-555555555555"


def handle(**changes: object) -> IpcHandle:
    fields: dict[str, object] = dict(
        host=host_id(), gpu_uuid=TRAINER_UUID, nbytes=4096, storage_class="TypedStorage",
        storage_handle=bytes(range(64)), storage_size_bytes=8192, storage_offset_bytes=0, tensor_offset=0,
        ref_counter_handle=b"\x00/torch_123_456\xff", ref_counter_offset=3, event_handle=bytes(64),
        event_sync_required=True)
    fields.update(changes)
    return IpcHandle(**fields)  # type: ignore[arg-type]


def test_a_handle_round_trips_through_plain_json_exactly() -> None:
    for h in (handle(), handle(event_handle=None, event_sync_required=False, storage_class="UntypedStorage")):
        text = encode_handle(h)
        assert json.loads(text)["format"] == "weightsync-cuda-ipc/1"  # plain JSON, bytes as base64
        assert decode_handle(text) == h


@pytest.mark.parametrize(("change", "needle"), [
    ({"storage_class": "Parameter"}, "storage class 'Parameter' is not one of"),
    ({"storage_class": "posix.system"}, "storage class 'posix.system' is not one of"),
    ({"storage_handle": "not base64!"}, "malformed CUDA IPC handle"),
    ({"format": "pickle"}, "not a weightsync-cuda-ipc/1 handle"),
    ({"nbytes": 9000}, "do not fit its 8192-byte storage"),
    ({"tensor_offset": 8000}, "do not fit its 8192-byte storage"),
])
def test_a_bad_handle_is_refused_naming_what_is_wrong(change: dict[str, object], needle: str) -> None:
    d = json.loads(encode_handle(handle()))
    d.update(change)
    with pytest.raises(ValueError, match=needle):
        decode_handle(json.dumps(d))


def test_a_field_missing_is_refused() -> None:
    d = json.loads(encode_handle(handle()))
    del d["ref_counter_handle"]
    with pytest.raises(ValueError, match="malformed CUDA IPC handle: KeyError"):
        decode_handle(json.dumps(d))


def test_a_handle_from_another_host_is_refused_before_anything_is_mapped() -> None:
    with pytest.raises(ValueError, match=r"made on host 0badc0de reached host [0-9a-f]{8}: CUDA IPC maps memory on "
                                         r"the host that exported it only"):
        check_local(handle(host="0badc0de"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of a process without CUDA")
def test_an_engine_without_cuda_refuses_naming_the_trainers_gpu() -> None:
    with pytest.raises(ValueError, match=f"slots are on GPU {TRAINER_UUID}; this engine process has no CUDA device"):
        check_local(handle())


def test_a_gpu_mismatch_names_both_uuids() -> None:
    engine = "GPU-99999999-8888-7777-6666-555555555555"
    text = mismatch_message(TRAINER_UUID, [engine])
    assert f"slots are on GPU {TRAINER_UUID}, this engine is on GPU {engine}" in text
    assert "same GPU only" in text


def test_the_link_carries_the_handle_and_the_receiver_checks_it_on_join() -> None:
    link = ShmLink(transport="shm", shm_name="weightsync-abc", slot_bytes=64, num_slots=2,
                   cuda_ipc=encode_handle(handle(host="0badc0de")))
    parsed = Link.from_dict(json.loads(json.dumps(link.to_dict())))
    assert parsed == link
    assert "cuda_ipc" not in ShmLink(transport="shm", shm_name="weightsync-abc", slot_bytes=64, num_slots=2).to_dict()
    receiver = ShmReceiver()
    with pytest.raises(ValueError, match="made on host 0badc0de"):
        receiver.join(parsed, rank=0)
    with pytest.raises(LookupError, match="is not mapped"):
        receiver.check_joined(parsed)


def test_the_transport_refuses_slot_devices_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="cuda_ipc=True puts the slots on a CUDA device, not cpu"):
        ShmTransport(cuda_ipc=True, device="cpu")
    with pytest.raises(ValueError, match="needs cuda_ipc=True"):
        ShmTransport(device="cuda")
    assert ShmTransport(cuda_ipc=True).buffer_device == torch.device("cuda")  # nothing is allocated before open()
    assert ShmTransport().buffer_device == torch.device("cpu")
