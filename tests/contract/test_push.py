"""The push contract, for every engine kind x every transport it declares (x {1, 2}
replicas where the kind has two), against real engines (`weightsync serve` processes
and a real vLLM): after a push every engine computes what the trainer computes, an
unchanged re-push changes nothing, a delta sends only what changed (or, to an engine
that declares no delta support, the whole model), and a mismatched model is refused
before any byte moves. Served digests are compared where the engine declares it reads
them (`reads_digests`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import weightsync as ws
from contract_helpers import (
    PROBE_PROMPTS,
    load_trainer,
    next_version,
    perturb,
    served_digests,
    served_state,
)
from engine_matrix import EMBEDDED, KINDS_BY_NAME, Client, EnginePool, engine_params
from weightsync.bucketing import plan_buckets
from weightsync.errors import EngineError
from weightsync.integrity import digest
from weightsync.manifest import Manifest
from weightsync.naming import map_names
from weightsync.server.launch import ServerProcess, launch_server
from weightsync.sources import ModuleSource

BUCKET_BYTES = 200 << 10  # several buckets for the ~1.7 MB tiny model
TIMEOUT_S = 30.0


def trainer_digests(model: torch.nn.Module) -> dict[str, str]:
    return {p.hf_name: digest(p.param.detach().contiguous()) for p in map_names(model).params}


def make_sync(engines: list[Client], transport: str, disk_root: Path, **kw: Any) -> ws.WeightSync:
    return ws.WeightSync(engines, transport=transport, bucket_bytes=BUCKET_BYTES, disk_root=str(disk_root),
                         timeout_s=TIMEOUT_S, **kw)


def assert_engine_matches(model: torch.nn.Module, engine: Client, version: int, engine_kind: str) -> None:
    result = ws.probe_logprobs(model, engine, PROBE_PROMPTS, max_new_tokens=6)
    assert result.token_agreement == 1.0, result
    assert result.max_gap < KINDS_BY_NAME[engine_kind].logprob_tolerance, result
    assert set(result.weight_versions) == {str(version)}
    served = served_digests(engine)
    assert served is None or served == trainer_digests(model)


@pytest.mark.parametrize(("engine_kind", "transport", "replicas"),
                         [p for p in engine_params(replicas=[1, 2]) if p.values[1:] != ("disk", 2)])
def test_push_then_engines_compute_what_the_trainer_computes(
    engine_kind: str, transport: str, replicas: int, engine_pool: EnginePool, tiny_model_dir: Path,
    disk_root: Path
) -> None:
    """Two replicas over every transport but disk (the suite's time): two replicas reading one version
    directory are tests/integration/test_vllm_inprocess.py's `test_two_replicas_over_disk_*`."""
    model = load_trainer(tiny_model_dir)
    clients = engine_pool.clients(engine_kind, replicas)
    with make_sync(clients, transport, disk_root) as sync:
        version = next_version()
        perturb(model, seed=version)
        report = sync.push(model, version=version)
        assert report.verified and report.num_buckets > 1 and len(report.acks) == replicas
        assert report.num_bytes == sum(p.numel() * 4 for p in model.parameters())
        for client in clients:
            assert_engine_matches(model, client, version, engine_kind)
        before = [ws.probe_logprobs(model, c, PROBE_PROMPTS) for c in clients]

        again = next_version()
        second = sync.push(model, version=again)  # unchanged weights
        assert second.verified and [a.digests for a in second.acks] == [a.digests for a in report.acks]
        for client, old in zip(clients, before, strict=True):
            now = ws.probe_logprobs(model, client, PROBE_PROMPTS)
            assert now.max_gap == pytest.approx(old.max_gap, abs=1e-7)
            assert set(now.weight_versions) == {str(again)}


@pytest.mark.parametrize(("engine_kind", "transport"), engine_params())
def test_a_push_hashed_with_the_device_digest_lands_verified(
    engine_kind: str, transport: str, engine_pool: EnginePool, tiny_model_dir: Path, disk_root: Path
) -> None:
    """wsmix64 (the digest CUDA buckets are hashed with in place) forced on CPU buffers:
    the engine computes it on receipt and acks the trainer's digests."""
    model = load_trainer(tiny_model_dir)
    clients = engine_pool.clients(engine_kind, 1)
    with make_sync(clients, transport, disk_root, digest_algorithm="wsmix64") as sync:
        version = next_version()
        perturb(model, seed=version)
        report = sync.push(model, version=version)
        assert report.verified and report.num_buckets > 1
        for client in clients:
            assert_engine_matches(model, client, version, engine_kind)


def test_an_unknown_digest_algorithm_is_refused_at_begin(engines: list[ServerProcess], tiny_model_dir: Path) -> None:
    model = load_trainer(tiny_model_dir)
    metas = ModuleSource(model).metas()
    manifest = Manifest(version=next_version(), buckets=plan_buckets(list(metas), BUCKET_BYTES),
                        digest_algorithm="blake3")
    client = ws.SGLangEngine(engines[0].url)
    with pytest.raises(EngineError, match="does not compute the digest algorithm 'blake3' the manifest names; "
                                          "it computes xxh3_64, wsmix64") as info:
        client._http.post("/weightsync/begin", {"manifest": manifest.to_dict()}, timeout_s=30)
    assert info.value.status == 400


@pytest.mark.parametrize(("engine_kind", "transport"), engine_params())
def test_delta_sends_only_changed_tensors(
    engine_kind: str, transport: str, engine_pool: EnginePool, tiny_model_dir: Path, disk_root: Path
) -> None:
    model = load_trainer(tiny_model_dir)
    clients = engine_pool.clients(engine_kind, KINDS_BY_NAME[engine_kind].num_replicas)
    applies_deltas = all(c.capabilities(TIMEOUT_S).supports_delta for c in clients)
    with make_sync(clients, transport, disk_root, mode="delta") as sync:
        first = sync.push(model, version=next_version())
        assert first.mode == "full"
        perturb(model, seed=7, only="layers.1.mlp")
        version = next_version()
        delta = sync.push(model, version=version)
        assert delta.verified
        if applies_deltas:
            changed = {n for n in trainer_digests(model) if "layers.1.mlp" in n}
            assert delta.mode == "delta" and delta.num_tensors == len(changed) == 3
            assert {n for a in delta.acks for n in a.loaded_names} == changed
        else:  # documented: to an engine that applies no partial update, a delta push goes out whole
            assert delta.mode == "full" and delta.num_skipped == 0, delta
            assert delta.num_tensors == len(trainer_digests(model)) and delta.num_bytes == first.num_bytes
        for client in clients:
            assert_engine_matches(model, client, version, engine_kind)


@pytest.mark.parametrize(("engine_kind", "transport"), engine_params())
def test_mismatched_model_is_refused_before_any_byte_moves(
    engine_kind: str, transport: str, engine_pool: EnginePool, tiny_model_dir: Path, disk_root: Path
) -> None:
    client = engine_pool.clients(engine_kind)[0]
    before = served_state(client)
    reshaped = load_trainer(tiny_model_dir)
    with torch.no_grad():
        reshaped.model.norm.weight = torch.nn.Parameter(torch.ones(129))
    renamed = load_trainer(tiny_model_dir)
    renamed.model.final_norm = renamed.model.norm
    del renamed.model.norm
    for bad, offender in ((reshaped, "model.norm.weight"), (renamed, "model.final_norm.weight")):
        with make_sync([client], transport, disk_root) as sync, pytest.raises(ws.ManifestMismatchError) as info:
            sync.push(bad, version=next_version())
        assert offender in str(info.value)
        assert served_state(client) == before


class _KillAfter:
    """A weight source that kills the engine (and waits until it is gone) before it
    yields tensor `n`, so everything the push sends from then on meets a dead engine."""

    def __init__(self, model: torch.nn.Module, server: ServerProcess, n: int) -> None:
        self.inner = ModuleSource(model)
        self.mode = "full"
        self.server = server
        self.n = n

    def metas(self) -> Any:
        return self.inner.metas()

    def tensors(self, hf_names: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(self.inner.tensors(hf_names)):
            if i == self.n:
                self.server.kill()
            yield item


@pytest.mark.parametrize(("engine_kind", "transport"), engine_params(kinds=[EMBEDDED]))
def test_engine_killed_mid_push_is_an_error_within_the_timeout(
    engine_kind: str, transport: str, tiny_model_dir: Path, disk_root: Path
) -> None:
    """Embedded engines only: each case starts (and kills) an engine of its own."""
    timeout_s = 5.0
    with launch_server(tiny_model_dir, args=["--disk-root", str(disk_root)]) as server:
        client = ws.SGLangEngine(server.url, timeout_s=timeout_s)
        model = load_trainer(tiny_model_dir)
        with ws.WeightSync([client], transport=transport, bucket_bytes=16 << 10, disk_root=str(disk_root),
                           timeout_s=timeout_s) as sync:
            start = time.monotonic()
            with pytest.raises(ws.WeightSyncError):
                sync.push(_KillAfter(model, server, n=4), version=next_version())
            elapsed = time.monotonic() - start
    assert elapsed < timeout_s * 2 + 5, f"took {elapsed:.1f}s"
