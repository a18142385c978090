"""A push to several `weightsync serve` replicas relayed along them (`fan_out="relay"`): the
trainer sends each bucket to the first engine, which checks its digest, stages it and
forwards it to the next, and so on; over http (engines forward over HTTP) and over
broadcast (point-to-point sends in a real gloo group). Real servers on 127.0.0.1; the
faults are injected by the fault rig's transport (`FaultyTransport`): the middle engine
killed mid-relay, and a corrupted bucket. Every push is all or nothing across the replicas."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import weightsync as ws
from contract_helpers import load_trainer, perturb
from serve_check import launch_servers
from weightsync.engines.serve import ServeClient
from weightsync.integrity import digest
from weightsync.server.launch import ServerProcess
from weightsync.transports import make_transport
from weightsync_tools.faults.inject import FaultyTransport

BUCKET_BYTES = 256 << 10
"""The tiny model (~1.7 MB) goes as several buckets, so a fault lands mid-relay."""
TIMEOUT_S = 20.0


@pytest.fixture(scope="module", params=["http", "broadcast"])
def transport(request: pytest.FixtureRequest) -> str:
    """Each test runs relayed over http and over broadcast, one transport's tests after the other's."""
    return str(request.param)


@pytest.fixture(scope="module")
def servers(transport: str, tiny_model_dir: Path) -> Iterator[list[ServerProcess]]:
    """Three engines per transport; the last test of the module kills the middle one."""
    with launch_servers(tiny_model_dir, 3, args=["--num-threads", "1"]) as servers:
        yield servers


def trainer(model_dir: Path, seed: int) -> torch.nn.Module:
    model = load_trainer(model_dir)
    perturb(model, seed)
    return model


def trainer_digests(model: torch.nn.Module) -> dict[str, str]:
    return {name: digest(t.contiguous()) for name, t in model.state_dict().items()}


def relay_info(server: ServerProcess) -> dict[str, dict[str, object]]:
    return httpx.get(f"{server.url}/weightsync/info", timeout=10).json()["relay"]


def relaying(transport: str, fault: str, **options: Any) -> FaultyTransport:
    """The transport for `WeightSync(..., fan_out="relay")` with `fault` injected."""
    return FaultyTransport(make_transport(transport, timeout_s=TIMEOUT_S, relay=True), fault, **options)


def test_a_relayed_push_goes_engine_to_engine_and_every_replica_serves_it(transport: str,
                                                                          servers: list[ServerProcess],
                                                                          tiny_model_dir: Path) -> None:
    engines = [ws.SGLangEngine(s.url) for s in servers]
    model = trainer(tiny_model_dir, seed=1)
    with ws.WeightSync(engines, transport=transport, fan_out="relay", bucket_bytes=BUCKET_BYTES,
                       timeout_s=TIMEOUT_S) as sync:
        report = sync.push(model, version=(version := 101))
    assert report.verified and report.num_buckets > 2
    assert any(note.startswith("relayed: the trainer sent each bucket to") for note in report.notes)
    want = trainer_digests(model)
    for engine in engines:
        assert engine.weight_version() == str(version) and engine.digests() == want
    # the first two engines forwarded every bucket (trainer -> 0 -> 1 -> 2); the last one none
    forwarded = [relay_info(s)["forwarded"].get(str(version), 0) for s in servers]
    assert forwarded == [report.num_buckets, report.num_buckets, 0]


def test_a_corrupted_bucket_goes_no_further_and_no_replica_changes(transport: str, servers: list[ServerProcess],
                                                                   tiny_model_dir: Path) -> None:
    engines = [ws.SGLangEngine(s.url) for s in servers]
    before = [(e.weight_version(), e.digests()) for e in engines]
    faulty = relaying(transport, "flip", at_bucket=2)
    with ws.WeightSync(engines, transport=faulty, fan_out="relay", bucket_bytes=BUCKET_BYTES,
                       timeout_s=TIMEOUT_S) as sync, pytest.raises(ws.WeightSyncError, match="bucket 2") as failed:
        sync.push(trainer(tiny_model_dir, seed=2), version=(version := 102))
    assert faulty.fired.is_set()
    assert servers[0].url in str(failed.value), "the first engine refused it"
    assert [(e.weight_version(), e.digests()) for e in engines] == before
    assert relay_info(servers[0])["forwarded"].get(str(version), 0) <= 2, "bucket 2 was never forwarded"
    model = trainer(tiny_model_dir, seed=3)
    with ws.WeightSync(engines, transport=transport, fan_out="relay", bucket_bytes=BUCKET_BYTES,
                       timeout_s=TIMEOUT_S) as sync:
        assert sync.push(model, version=103).verified
    assert all(e.digests() == trainer_digests(model) for e in engines)


class _CannotRelayServe(ServeClient):
    """weightsync serve's own verbs, of an engine that cannot take its part in the relay (after
    begin): over broadcast it cannot start its hop in the group, over http it cannot take the
    first bucket."""

    def relay_in_group(self, *args: Any, **kwargs: Any) -> None:
        raise ws.EngineError(self.label, "injected: this engine cannot start its hop")

    def relay(self, *args: Any, **kwargs: Any) -> None:
        raise ws.EngineError(self.label, "injected: this engine cannot relay")


class _CannotRelay(ws.SGLangEngine):
    """A client of such an engine."""

    serve_client = _CannotRelayServe


def test_a_relay_that_cannot_run_after_begin_leaves_no_update_open(transport: str, servers: list[ServerProcess],
                                                                   tiny_model_dir: Path) -> None:
    """Every engine has begun when the relay fails: each one's update is aborted (none stays
    open until it expires), no replica changes, and the next push succeeds."""
    engines = [ws.SGLangEngine(s.url) for s in servers]
    before = [(e.weight_version(), e.digests()) for e in engines]
    with ws.WeightSync([_CannotRelay(servers[0].url), *engines[1:]], transport=transport, fan_out="relay",
                       bucket_bytes=BUCKET_BYTES, timeout_s=TIMEOUT_S) as sync, \
            pytest.raises(ws.EngineError, match="injected: this engine cannot"):
        sync.push(trainer(tiny_model_dir, seed=7), version=150)
    sessions = [httpx.get(f"{s.url}/weightsync/info?only=session", timeout=10).json()["session"] for s in servers]
    assert sessions == [None, None, None], "every engine's update was aborted"
    assert [(e.weight_version(), e.digests()) for e in engines] == before
    model = trainer(tiny_model_dir, seed=8)
    with ws.WeightSync(engines, transport=transport, fan_out="relay", bucket_bytes=BUCKET_BYTES,
                       timeout_s=TIMEOUT_S) as sync:
        assert sync.push(model, version=151).verified
    assert all(e.digests() == trainer_digests(model) for e in engines)


def test_the_middle_engine_lost_mid_relay_fails_the_push_naming_the_hop(transport: str, servers: list[ServerProcess],
                                                                        tiny_model_dir: Path) -> None:
    """Last in the module: it kills the middle engine of this transport's servers."""
    engines = [ws.SGLangEngine(s.url) for s in servers]
    first = trainer(tiny_model_dir, seed=4)
    with ws.WeightSync(engines, transport=transport, fan_out="relay", bucket_bytes=BUCKET_BYTES,
                       timeout_s=TIMEOUT_S) as sync:
        assert sync.push(first, version=201).verified
    faulty = relaying(transport, "kill", at_bucket=2, at_push=1, rig=servers[1])
    with ws.WeightSync(engines, transport=faulty, fan_out="relay", bucket_bytes=BUCKET_BYTES,
                       timeout_s=TIMEOUT_S) as sync, pytest.raises(ws.EngineError) as failed:
        sync.push(trainer(tiny_model_dir, seed=5), version=202)
    # the first engine names its hop to the lost one (over broadcast: with its rank in the group)
    assert failed.value.engine == servers[0].url
    assert re.search(rf"to {re.escape(servers[1].url)}( \(rank \d+\))? failed", str(failed.value))
    survivors = [engines[0], engines[2]]
    assert all(e.weight_version() == "201" and e.digests() == trainer_digests(first) for e in survivors)
    again = trainer(tiny_model_dir, seed=6)
    with ws.WeightSync(survivors, transport=transport, fan_out="relay", bucket_bytes=BUCKET_BYTES,
                       timeout_s=TIMEOUT_S) as sync:
        assert sync.push(again, version=203).verified
    assert all(e.digests() == trainer_digests(again) for e in survivors)
