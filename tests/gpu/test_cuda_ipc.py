"""CUDA IPC for the shm transport where trainer and engine share a GPU (`ShmTransport(cuda_ipc=True)`).
Runs where CUDA is present; skipped, with the reason, everywhere else. Not yet run on a GPU.

Shown: an engine process maps the trainer's CUDA slots from the link's JSON handle and reads
exactly the trainer's bytes, hashed on the device (wsmix64 equal to the CPU's); a handle naming
another GPU is refused naming both UUIDs; a full push from a GPU trainer into `weightsync serve`
over CUDA IPC is verified and served byte for byte."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from weightsync.digests import WSMIX64, digest
from weightsync.transports.cuda_ipc import decode_handle, encode_handle
from weightsync.transports.shm import ShmLink, ShmReceiver, ShmTransport

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ENGINE = """
import json, sys, torch
from weightsync.links import Delivery, Link
from types import SimpleNamespace
from weightsync.digests import digest
from weightsync.transports.shm import ShmReceiver
spec = json.loads(sys.stdin.read())
link = Link.from_dict(spec["link"])
receiver = ShmReceiver()
receiver.join(link, rank=0)
out = []
for slot, nbytes in spec["slots"]:
    bucket = SimpleNamespace(index=slot, nbytes=nbytes)  # all the receiver reads of a bucket
    into = torch.empty(nbytes, dtype=torch.uint8, device=spec["into"])
    _, hashed = receiver.fetch_hashed(link, bucket, Delivery(transport="shm", slot=slot), into, "wsmix64")
    out.append({"device_digest": hashed, "copied_digest": digest(into.cpu(), "wsmix64")})
receiver.close()
print(json.dumps(out))
"""


def engine_reads(link: ShmLink, slots: list[tuple[int, int]], into: str) -> list[dict[str, str]]:
    spec = {"link": link.to_dict(), "slots": slots, "into": into}
    done = subprocess.run([sys.executable, "-c", ENGINE], input=json.dumps(spec), capture_output=True, text=True,
                          timeout=120, env=None)
    assert done.returncode == 0, done.stderr[-3000:]
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("into", ["cpu", "cuda"])
def test_an_engine_process_maps_the_trainers_cuda_slots_and_reads_its_bytes(into: str) -> None:
    transport = ShmTransport(cuda_ipc=True)
    try:
        (link,) = transport.open([1], max_bucket_bytes=3 << 20)
        assert isinstance(link, ShmLink) and link.cuda_ipc is not None
        assert decode_handle(link.cuda_ipc).gpu_uuid == str(torch.cuda.get_device_properties(0).uuid)
        gen = torch.Generator(device="cuda").manual_seed(7)
        sizes = [3 << 20, (1 << 20) + 3]
        expected = []
        transport.begin(SimpleNamespace(buckets=sizes))  # type: ignore[arg-type]
        for slot, nbytes in enumerate(sizes):
            data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)
            buffer = transport.slot(slot, nbytes)
            buffer.copy_(data)
            transport.deliver(SimpleNamespace(index=slot, nbytes=nbytes), buffer)  # type: ignore[arg-type]
            expected.append(digest(data.cpu(), WSMIX64))
            assert digest(data, WSMIX64) == expected[-1]  # the device's digest is the CPU's
        got = engine_reads(link, list(enumerate(sizes)), into)
        assert [g["device_digest"] for g in got] == expected
        assert [g["copied_digest"] for g in got] == expected
    finally:
        transport.close()


def test_a_handle_naming_another_gpu_is_refused_naming_both_uuids() -> None:
    transport = ShmTransport(cuda_ipc=True)
    try:
        (link,) = transport.open([1], max_bucket_bytes=1024)
        assert isinstance(link, ShmLink) and link.cuda_ipc is not None
        other = "GPU-00000000-0000-0000-0000-000000000000"
        forged = dataclasses.replace(decode_handle(link.cuda_ipc), gpu_uuid=other)
        mine = str(torch.cuda.get_device_properties(0).uuid)
        with pytest.raises(ValueError, match=f"slots are on GPU {other}, this engine is on GPU .*{mine}"):
            ShmReceiver().join(dataclasses.replace(link, cuda_ipc=encode_handle(forged)), rank=0)
    finally:
        transport.close()


def test_a_gpu_trainer_pushes_into_weightsync_serve_over_cuda_ipc(tmp_path: Path) -> None:
    import weightsync as ws
    from weightsync.integrity import digest as served_digest
    from weightsync.server.launch import launch_server
    from weightsync.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny")
    server = launch_server(model_dir, args=["--num-threads", "4"])
    try:
        from transformers import AutoModelForCausalLM

        trainer = AutoModelForCausalLM.from_pretrained(model_dir).cuda()
        with torch.no_grad():
            for t in trainer.state_dict().values():
                if t.is_floating_point():
                    t.add_(1e-2)
        engine = ws.SGLangEngine(server.url)
        with ws.WeightSync([engine], transport=ShmTransport(cuda_ipc=True, timeout_s=30), timeout_s=30) as sync:
            report = sync.push(trainer, version=(version := int(engine.weight_version()) + 1))
        assert report.verified and engine.weight_version() == str(version), report
        served = engine.digests()
        assert served == {n: served_digest(t.detach().cpu()) for n, t in trainer.state_dict().items() if n in served}
        print(f"\ncuda ipc push: {report.num_bytes} bytes in {report.seconds * 1e3:.1f} ms, stages {report.stages}")
    finally:
        server.close()
