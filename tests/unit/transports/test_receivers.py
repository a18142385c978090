"""The engine ends of the transports: what the trainer end delivers, the receiver
hands over byte for byte; sessions are kept by name, the oldest left first.

Broadcast needs a second process: its receiver runs in tests/integration
(`weightsync serve`) and the vLLM tests.
"""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path

import pytest
import torch

from weightsync.bucketing import pack, plan_buckets
from weightsync.errors import IntegrityError
from weightsync.integrity import digest
from weightsync.manifest import BucketMeta, Manifest, TensorMeta
from weightsync.transports import TRANSPORTS, make_receiver, make_transport, receiver_class
from weightsync.transports.base import Joined

TENSORS = {
    "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b.bias": torch.tensor(2.5, dtype=torch.bfloat16),
    "c.weight": torch.ones(40, dtype=torch.int8),
}


def _manifest(version: int = 1) -> tuple[Manifest, list[torch.Tensor]]:
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in TENSORS.items()], 48)
    buffers = [pack(b, {n: TENSORS[n] for n in b.hf_names}) for b in plan]
    return Manifest(version=version, buckets=plan).with_digests([digest(b) for b in buffers]), buffers


def _received_per_bucket(name: str) -> list[torch.Tensor]:
    """Push every bucket through transport `name`'s trainer end, fetched by its engine end."""
    manifest, buffers = _manifest()
    transport = make_transport(name)
    receiver = make_receiver(name)
    try:
        (link,) = transport.open([1], max_bucket_bytes=max(b.nbytes for b in manifest.buckets))
        receiver.join(link, rank=0)
        transport.establish()
        transport.begin(manifest)
        got = []
        for k, (bucket, packed) in enumerate(zip(manifest.buckets, buffers, strict=True)):
            slot = transport.slot(k, bucket.nbytes)
            slot.copy_(packed)
            delivery = transport.deliver(bucket, slot)
            got.append(receiver.fetch(link, bucket, delivery, torch.empty(bucket.nbytes, dtype=torch.uint8)))
        receiver.leave(link)
        return got
    finally:
        receiver.close()
        transport.close()


@pytest.mark.parametrize("name", ["http", "shm"])
def test_per_bucket_receivers_hand_over_the_delivered_bytes(name: str) -> None:
    _, buffers = _manifest()
    got = _received_per_bucket(name)
    assert [digest(b) for b in got] == [digest(b) for b in buffers]


def test_shm_receiver_refuses_a_segment_it_did_not_map() -> None:
    manifest, _ = _manifest()
    transport = make_transport("shm")
    try:
        (link,) = transport.open([1], max_bucket_bytes=64)
        transport.begin(manifest)
        delivery = transport.deliver(manifest.buckets[0], transport.slot(0, manifest.buckets[0].nbytes))
        receiver = make_receiver("shm")
        with pytest.raises(LookupError, match="is not mapped: connect"):
            receiver.check_joined(link)
        receiver.join(link, rank=0)
        receiver.check_joined(link)
        with pytest.raises(LookupError, match="mapped as 2 slots of .* the link says 2 of 1"):
            receiver.check_joined(dataclasses.replace(link, slot_bytes=1))  # a link with another layout
        receiver.close()
        with pytest.raises(LookupError, match="is not mapped"):
            receiver.fetch(link, manifest.buckets[0], delivery, torch.empty(manifest.buckets[0].nbytes,
                                                                             dtype=torch.uint8))
    finally:
        transport.close()


def test_disk_receiver_reads_the_published_version(tmp_path: Path) -> None:
    manifest, buffers = _manifest(version=3)
    transport = make_transport("disk", disk_root=tmp_path)
    (link,) = transport.open([1], max_bucket_bytes=64)
    transport.begin(manifest)
    for bucket, packed in zip(manifest.buckets, buffers, strict=True):
        transport.deliver(bucket, packed)
    transport.finish(manifest)
    got = dict(make_receiver("disk").read(link, manifest))
    assert {i: digest(b) for i, b in got.items()} == {i: digest(b) for i, b in enumerate(buffers)}
    other, _ = _manifest(version=3)
    with pytest.raises(IntegrityError, match="not the manifest begin"):
        dict(make_receiver("disk").read(link, Manifest(version=3, buckets=other.buckets[:1])))
    # into the places a reader keeps (the vLLM workers' host staging), checked there
    places = {b.index: torch.full((b.nbytes,), 7, dtype=torch.uint8) for b in manifest.buckets}
    placed = dict(make_receiver("disk").read(link, manifest, lambda bucket: places[bucket.index]))
    assert all(placed[i] is places[i] for i in places)
    assert {i: digest(b) for i, b in places.items()} == {i: digest(b) for i, b in enumerate(buffers)}
    # a streamed reader lets each bucket go before the next is read: the reader keeps none of them
    read: list[weakref.ref[torch.Tensor]] = []

    def fresh_place(bucket: BucketMeta) -> torch.Tensor:
        assert [r for r in read if r() is not None] == [], f"bucket {bucket.index} read with the last one held"
        place = torch.empty(bucket.nbytes, dtype=torch.uint8)
        read.append(weakref.ref(place))
        return place

    for _index, buffer in make_receiver("disk").read(link, manifest, fresh_place):
        del buffer
    assert len(read) == len(manifest.buckets) > 1
    path = tmp_path / "v00000003" / "bucket-00000.safetensors"
    path.write_bytes(path.read_bytes()[:-1])  # a short bucket file is refused wherever it is read to
    with pytest.raises(IntegrityError, match="manifest says"):
        dict(make_receiver("disk").read(link, manifest, lambda bucket: places[bucket.index]))


def test_receiver_traits_tell_engines_what_to_do() -> None:
    """Exactly the traits the engine clients dispatch on, per transport."""
    traits = {n: (c.joins_session, c.bytes_in_delivery, c.reads_at_commit, c.collective)
              for n in TRANSPORTS for c in [receiver_class(n)]}
    assert traits == {
        "disk": (False, False, True, False),
        "http": (False, True, False, False),
        "broadcast": (True, False, False, True),
        "shm": (True, False, False, False),
    }


def test_joined_sessions_keep_the_newest_and_leave_the_oldest() -> None:
    left: list[str] = []
    joined: Joined[str] = Joined(2, left.append)
    joined.add("a", "A")
    joined.add("b", "B")
    joined.add("a", "A2")  # the same name again: the old one is left first
    assert left == ["A"]
    joined.add("c", "C")
    assert left == ["A", "B"] and "a" in joined and "c" in joined and "b" not in joined
    joined.clear()
    assert sorted(left) == ["A", "A2", "B", "C"]
    with pytest.raises(ValueError, match="max_sessions must be at least 1"):
        Joined(0, left.append)
