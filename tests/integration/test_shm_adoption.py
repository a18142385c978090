"""shm pushes into engines that adopt the slots (`weightsync serve`, default-built):
the served weights live in the trainer's segment, no push ever writes a slot an
engine serves from, and a failed push costs a fresh segment, not served bytes.

Everything goes through the public API as the README writes it: an fp32 trainer,
bf16 engines, `WeightSync(engines, transport="shm")`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

import weightsync as ws
from serve_check import launch_servers
from weightsync.errors import EngineError
from weightsync.integrity import digest
from weightsync.manifest import BucketMeta, Manifest
from weightsync.naming import map_names
from weightsync.reports import Ack
from weightsync.server.launch import ServerProcess
from weightsync.tiny import TinyModelConfig, make_tiny_model
from weightsync.transports.base import typed
from weightsync.transports.shm import ShmLink, ShmTransport
from weightsync_tools.faults import faulty
from weightsync_tools.faults.inject import fail_in_commit_round

BUCKET_BYTES = 64 << 10  # a dozen buckets for the tiny model


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bf16") / "tiny", TinyModelConfig(dtype="bfloat16"))


@pytest.fixture(scope="module")
def servers(bf16_dir: Path) -> Iterator[list[ServerProcess]]:
    with launch_servers(bf16_dir, 2) as servers:
        yield servers


def _trainer(tiny_model_dir: Path, seed: int) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _as_served(model: torch.nn.Module) -> dict[str, str]:
    """Digests of the trainer's weights as a bf16 engine must serve them."""
    return {p.hf_name: digest(p.param.detach().to(torch.bfloat16).contiguous()) for p in map_names(model).params}


def _mapped_segments(server: ServerProcess) -> set[str]:
    """Names of the weightsync shm segments the server process has mapped (with " (deleted)"
    once their name is gone)."""
    lines = Path(f"/proc/{server.pid}/maps").read_text().splitlines()
    return {line.split("/dev/shm/", 1)[1] for line in lines if "/dev/shm/weightsync-" in line}


def test_engines_serve_from_the_slots_and_no_push_writes_a_held_one(
        servers: list[ServerProcess], tiny_model_dir: Path) -> None:
    engines = [ws.SGLangEngine(s.url) for s in servers]
    sync = ws.WeightSync(engines, transport="shm", bucket_bytes=BUCKET_BYTES)
    previous: set[int] = set()
    version = max(int(e.weight_version()) for e in engines)
    for step in range(4):
        model = _trainer(tiny_model_dir, seed=step)
        version += 1
        report = sync.push(model, version=version)
        assert report.verified and report.num_buckets > 4
        held = [ack.held_slots for ack in report.acks]
        assert held[0] == held[1] and len(held[0]) == 1, held  # both replicas serve from the same slots
        [(segment, slots)] = held[0].items()
        assert len(slots) == report.num_buckets and not previous & set(slots), (previous, slots)
        previous = set(slots)
        for engine, server in zip(engines, servers, strict=True):
            assert engine.digests() == _as_served(model)  # the last push wrote none of the slots served before
            assert segment in _mapped_segments(server)
    sync.close()  # the trainer removes the segment's name; the engines keep serving its pages
    for engine, server in zip(engines, servers, strict=True):
        assert engine.digests() == _as_served(model)
        assert f"{segment} (deleted)" in _mapped_segments(server)
        assert set(ws.probe_logprobs(model, engine, [[5, 17, 42, 7]]).weight_versions) == {str(version)}


def test_a_failed_push_leaves_the_served_slots_alone_and_the_next_push_lands(
        servers: list[ServerProcess], tiny_model_dir: Path) -> None:
    engines = [ws.SGLangEngine(s.url) for s in servers]
    version = max(int(e.weight_version()) for e in engines) + 1
    transport = faulty("shm", "flip", at_push=2, at_bucket=3, timeout_s=30.0)
    sync = ws.WeightSync(engines, transport=transport, bucket_bytes=BUCKET_BYTES)
    good = _trainer(tiny_model_dir, seed=10)
    first = sync.push(good, version=version)
    assert first.verified and first.acks[0].held_slots
    with pytest.raises(EngineError, match="corrupted in transit"):
        sync.push(_trainer(tiny_model_dir, seed=11), version=version + 1)
    for engine in engines:
        assert engine.weight_version() == str(version)
        assert engine.digests() == _as_served(good)
    after = _trainer(tiny_model_dir, seed=12)
    third = sync.push(after, version=version + 2)
    assert third.verified
    [old] = first.acks[0].held_slots
    [new] = third.acks[0].held_slots
    assert new != old  # the failed push's slots might have been held: a fresh segment, no guessing
    for engine in engines:
        assert engine.digests() == _as_served(after)
    sync.close()


def test_a_replica_that_cannot_commit_rolls_the_other_back_onto_its_slots(
        servers: list[ServerProcess], tiny_model_dir: Path) -> None:
    """Replica 1 commits v+1 out of fresh slots; replica 0's update is then dropped (its
    session gone: a restart, an expiry) before its commit goes out, so the push fails and
    replica 1 rolls back: it serves v again from the slots it held, bit for bit, and the
    next push, which writes none of them, lands on both."""
    engines = [ws.SGLangEngine(s.url) for s in servers]
    version = max(int(e.weight_version()) for e in engines) + 1
    sync = ws.WeightSync(engines, transport="shm", bucket_bytes=BUCKET_BYTES)
    good = _trainer(tiny_model_dir, seed=20)
    first = sync.push(good, version=version)
    assert first.verified and first.acks[0].held_slots

    def drop_update() -> None:
        httpx.post(f"{servers[0].url}/weightsync/abort", json={"version": version + 1}).raise_for_status()

    sync._replicas.engines = fail_in_commit_round(engines, 0, 1, drop_update)
    with pytest.raises(EngineError, match="no update session is open") as info:
        sync.push(_trainer(tiny_model_dir, seed=21), version=version + 1)
    assert any("rolled back to the last version" in note for note in info.value.__notes__)
    sync._replicas.engines = engines
    for engine in engines:
        assert engine.weight_version() == str(version)
        assert engine.digests() == _as_served(good)
    after = _trainer(tiny_model_dir, seed=22)
    assert sync.push(after, version=version + 2).verified
    for engine in engines:
        assert engine.digests() == _as_served(after)
    sync.close()


def _manifest(num_buckets: int, version: int = 1) -> Manifest:
    return Manifest(version=version, buckets=[BucketMeta(index=k, entries=()) for k in range(num_buckets)])


def test_leased_slots_skip_the_held_ones_and_a_failure_starts_a_new_segment() -> None:
    transport = ShmTransport()
    try:
        (opened,) = transport.open([1], max_bucket_bytes=64, leased_buckets=3)
        link = typed(opened, ShmLink)
        assert link.num_slots == 6 and link.adopt
        name = link.shm_name
        transport.begin(_manifest(3))
        first = [transport.deliver(BucketMeta(index=k, entries=()), transport.slot(k, 8)).slot for k in range(3)]
        assert first == [0, 1, 2]
        transport.committed([Ack(engine="a", version=1, held_slots={name: (0, 1, 2)}),
                             Ack(engine="b", version=1, held_slots={"weightsync-other": (3,)})])
        assert transport.open([1], max_bucket_bytes=64, leased_buckets=3) == [link]  # 3 free: same segment
        transport.begin(_manifest(3, version=2))
        assert [transport.deliver(BucketMeta(index=k, entries=()), transport.slot(k, 8)).slot
                for k in range(3)] == [3, 4, 5]
        transport.discard(2)  # v2 may have committed somewhere: 0-5 all held
        (fresh,) = transport.open([1], max_bucket_bytes=64, leased_buckets=3)
        assert typed(fresh, ShmLink).shm_name != name
        (ring,) = transport.open([1], max_bucket_bytes=64)  # engines that copy: two reused slots
        assert typed(ring, ShmLink).num_slots == 2 and not typed(ring, ShmLink).adopt
    finally:
        transport.close()
