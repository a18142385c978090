"""Transports' trainer end to their engine end in one process, byte for byte, over
more than one push: disk's published versions and their pruning, shm's slots when
engines adopt them.

tests/unit/transports/test_receivers.py covers one push per transport and the
receivers' traits. Broadcast cannot run both ends in one process: torch registers a
process group by name once per process, and both ends form the same group; its ends
meet in tests/distributed/test_fsdp_push.py and the `weightsync serve` tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync import Ack, Manifest, TensorMeta, pack, plan_buckets
from weightsync.integrity import digest
from weightsync.transports import make_receiver, make_transport


def manifest(version: int, *, seed: int = 0) -> tuple[Manifest, list[torch.Tensor]]:
    """Three buckets of seeded tensors (fp32, bf16 0-d, int8), packed."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"a.weight": torch.randn(3, 4, generator=gen),
               "b.bias": torch.randn((), generator=gen).to(torch.bfloat16),
               "c.weight": torch.randint(-100, 100, (40,), generator=gen, dtype=torch.int8)}
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], 48)
    buffers = [pack(b, {n: tensors[n] for n in b.hf_names}) for b in plan]
    return Manifest(version=version, buckets=plan).with_digests([digest(b) for b in buffers]), buffers


def publish(transport: Any, m: Manifest, buffers: list[torch.Tensor]) -> None:
    transport.begin(m)
    for k, (bucket, packed) in enumerate(zip(m.buckets, buffers, strict=True)):
        slot = transport.slot(k, bucket.nbytes)
        slot.copy_(packed)
        transport.deliver(bucket, slot)
    transport.finish(m)


def test_disk_keeps_the_newest_versions_and_leaves_nothing_of_a_discarded_one(tmp_path: Path) -> None:
    transport = make_transport("disk", disk_root=tmp_path, keep_versions=2)
    (link,) = transport.open([1], max_bucket_bytes=64)
    receiver = make_receiver("disk")
    pushed = {}
    for version in (1, 2, 3):
        pushed[version] = manifest(version, seed=version)
        publish(transport, *pushed[version])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000003"]
    for version in (2, 3):
        m, buffers = pushed[version]
        assert {i: digest(b) for i, b in receiver.read(link, m)} == {i: digest(b) for i, b in enumerate(buffers)}
    failed, buffers = manifest(4, seed=4)
    transport.begin(failed)
    transport.deliver(failed.buckets[0], buffers[0])
    transport.discard(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000003"]
    again, buffers = manifest(3, seed=30)  # a re-push of a version replaces it
    publish(transport, again, buffers)
    assert {i: digest(b) for i, b in receiver.read(link, again)} == {i: digest(b) for i, b in enumerate(buffers)}
    transport.close()
    with pytest.raises(ValueError, match="keep_versions must be at least 1, got 0"):
        make_transport("disk", disk_root=tmp_path, keep_versions=0)


def test_shm_slots_an_engine_adopted_are_not_written_until_it_lets_them_go() -> None:
    """Engines that serve from the segment (leased buckets): each bucket has a slot of its
    own, and the slots named in the acks stay untouched by the next push."""
    m1, buffers1 = manifest(1, seed=1)
    transport = make_transport("shm")
    receiver = make_receiver("shm")
    try:
        (link,) = transport.open([1], max_bucket_bytes=64, leased_buckets=len(m1.buckets))
        receiver.join(link, rank=0)
        transport.begin(m1)
        adopted = []
        for k, (bucket, packed) in enumerate(zip(m1.buckets, buffers1, strict=True)):
            transport.slot(k, bucket.nbytes).copy_(packed)
            view = receiver.adopt(link, bucket, transport.deliver(bucket, transport.slot(k, bucket.nbytes)))
            assert view is not None and torch.equal(view, packed)
            adopted.append(view)
        held = receiver.held_slots(adopted)
        assert len(held[link.shm_name]) == len(m1.buckets) == len(set(held[link.shm_name]))
        transport.committed([Ack(engine="e", version=1, held_slots=held)])

        m2, buffers2 = manifest(2, seed=2)
        assert transport.open([1], max_bucket_bytes=64, leased_buckets=len(m2.buckets)) == [link]
        transport.begin(m2)
        for k, (bucket, packed) in enumerate(zip(m2.buckets, buffers2, strict=True)):
            delivery = transport.deliver(bucket, transport.slot(k, bucket.nbytes))
            assert delivery.slot not in held[link.shm_name]
            transport.slot(k, bucket.nbytes).copy_(packed)
        for view, packed in zip(adopted, buffers1, strict=True):  # what the engine serves is intact
            assert torch.equal(view, packed)
    finally:
        receiver.close()
        transport.close()


def test_a_failed_shm_push_keeps_only_the_slots_it_delivered_from_the_next_pushes() -> None:
    """After a failure an engine may serve from what it got (it may have committed), so
    those slots stay unwritten; the slots of buckets never delivered (the producer packs
    while the engines begin, so a refused begin leaves some packed) are free again."""
    m1, _ = manifest(1, seed=1)
    transport = make_transport("shm")
    try:
        transport.open([1], max_bucket_bytes=64, leased_buckets=len(m1.buckets))
        transport.begin(m1)
        delivered = transport.deliver(m1.buckets[0], transport.slot(0, m1.buckets[0].nbytes)).slot
        transport.slot(1, m1.buckets[1].nbytes)  # packed, never delivered: the push fails here
        transport.discard(1)
        m2, _ = manifest(2, seed=2)
        transport.begin(m2)
        slots = {transport.deliver(b, transport.slot(k, b.nbytes)).slot for k, b in enumerate(m2.buckets)}
        assert delivered not in slots, "a slot an engine got stays unwritten"
        first_push = set(range(len(m1.buckets)))  # a fresh segment's free slots go lowest first
        assert slots & (first_push - {delivered}), "the slots no engine got are free again"
    finally:
        transport.close()
