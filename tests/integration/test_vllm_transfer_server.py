"""weightsync as vLLM's own weight-transfer backend: a REAL `vllm serve
--weight-transfer-config '{"backend":"weightsync"}'` (VLLM_SERVER_DEV_MODE=1).

The trainer drives vLLM's RL routes (`/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`), which
answer fixed messages; every worker's answer comes back on the data plane.
The backend reaches the server's processes through the `vllm.general_plugins`
entry point of this checkout's pyproject.toml (`vllm_support.plugin_installed`).
Shows: pushes over shm and disk give transformers' greedy tokens; a corrupted
bucket, a stale version and a wrong shape leave the last good weights serving; a trainer
SIGKILLed mid-push leaves vLLM serving and the next push takes over at once;
an unsalted request after a push never reuses the old weights' prefix KV.
The server is the session's float32 `vllm serve` (tests/support/vllm_shared_server.py), started
with the backend; each test pushes from the served version upward.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

import vllm_fixtures as vf
import weightsync as ws
from weightsync.engines.vllm.launch import VLLMServer
from weightsync.engines.vllm.transfer_client import VLLMTransferEngine
from weightsync.reports import SyncReport
from weightsync_tools import faults

vf.require_vllm()
pytestmark = pytest.mark.vllm

@pytest.fixture(scope="module")
def model_dir(vllm_model_dir: Path) -> Path:
    return vllm_model_dir


@pytest.fixture(scope="module")
def server(vllm_server: VLLMServer) -> VLLMServer:
    """The session's float32 `vllm serve` (tests/support/vllm_shared_server.py), with the weightsync backend."""
    return vllm_server


@pytest.fixture(scope="module")
def engine(server: VLLMServer) -> Iterator[VLLMTransferEngine]:
    engine = VLLMTransferEngine(server.url, timeout_s=120)
    yield engine
    engine.close()


def _push(engine: VLLMTransferEngine, model_dir: Path, seed: int, **options: Any) -> torch.nn.Module:
    """Push a freshly perturbed trainer, verified; returns it (what vLLM now serves)."""
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=seed)
    with ws.WeightSync([engine], **{"transport": "shm", **options}) as sync:
        version = vf.next_version(engine)
        vf.assert_verified(sync.push(trainer, version=version), version)
    return trainer


@pytest.mark.parametrize("transport", ["shm", "disk"])
def test_full_push_matches_transformers(engine: VLLMTransferEngine, model_dir: Path, tmp_path: Path,
                                        transport: str) -> None:
    trainer = _push(engine, model_dir, seed=300 + len(transport), transport=transport, bucket_bytes=256 << 10,
                    disk_root=str(tmp_path))
    gap = vf.assert_parity(engine, trainer)
    completion = engine.generate([vf.PROMPTS[0]], max_new_tokens=2)[0]
    assert completion.weight_version == engine.weight_version()
    print(f"\n{transport} over vLLM's RL routes: max logprob gap {gap:.2e}")


def test_corrupted_bucket_stale_version_and_wrong_shape_keep_the_last_good_weights(engine: VLLMTransferEngine,
                                                                        model_dir: Path) -> None:
    good = _push(engine, model_dir, seed=311)
    served = int(engine.info()["version"])
    bad = vf.load_trainer(model_dir)
    vf.perturb(bad, seed=312)
    with ws.WeightSync([vf.CorruptingEngine(engine)], transport="shm", bucket_bytes=256 << 10) as sync, \
            pytest.raises(ws.IntegrityError, match="bucket 1: digest"):
        sync.push(bad, version=served + 1)
    with ws.WeightSync([engine], transport="shm") as sync, pytest.raises(ws.EngineError, match="not newer"):
        sync.push(bad, version=served)
    bad.model.norm.weight = torch.nn.Parameter(torch.ones(130))  # the engine's is (128,)
    with ws.WeightSync([engine], transport="shm") as sync, \
            pytest.raises(ws.ManifestMismatchError, match=r"model\.norm\.weight"):
        sync.push(bad, version=served + 1)
    assert int(engine.info()["version"]) == served
    vf.assert_parity(engine, good)
    vf.assert_parity(engine, _push(engine, model_dir, seed=313))


def test_trainer_killed_mid_push_leaves_vllm_serving(engine: VLLMTransferEngine, model_dir: Path,
                                                     server: VLLMServer, tmp_path: Path) -> None:
    good = _push(engine, model_dir, seed=321)
    served = int(engine.info()["version"])
    doomed = copy.deepcopy(good)
    vf.perturb(doomed, seed=322)
    weights = {name: p.detach().contiguous() for name, p in doomed.named_parameters()}
    save_file(weights, str(tmp_path / "weights.safetensors"))
    spec = {"url": server.url, "api_key": None, "engine": "vllm-transfer", "transport": "shm",
            "weights": str(tmp_path / "weights.safetensors"), "order": list(weights), "version": served + 1,
            "disk_root": str(tmp_path / "versions"), "bucket_bytes": faults.BUCKET_BYTES, "timeout_s": 60.0,
            "fault": "block", "at_bucket": 2}
    with faults.ChildTrainer(spec) as child:
        ready = child.wait_for("READY", faults.CHILD_READY_TIMEOUT_S)
        assert ready is not None, child.tail()
        child.kill()  # buckets 0 and 1 are staged in the workers; vLLM's update session is open
    assert int(engine.info()["version"]) == served
    vf.assert_parity(engine, good)
    vf.assert_next_push_takes_over(engine, model_dir, version=served + 1, seed=323)


def test_unsalted_requests_never_reuse_old_weight_kv(engine: VLLMTransferEngine, model_dir: Path,
                                                     server: VLLMServer) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(2, 512) for _ in range(300)]  # two full 128-token KV blocks and a part

    def greedy() -> list[int]:
        body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}  # no cache_salt: only the reset after the push protects it
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        return list(response.json()["choices"][0]["token_ids"])

    old = _push(engine, model_dir, seed=331)
    assert greedy() == vf.reference_greedy(old, prompt, 8)[0]  # the prompt's KV is cached now
    new = _push(engine, model_dir, seed=332)
    assert greedy() == vf.reference_greedy(new, prompt, 8)[0] != vf.reference_greedy(old, prompt, 8)[0]


def test_vllm_trainer_api_takes_a_vllm_033_weight_source(server: VLLMServer, model_dir: Path) -> None:
    """vLLM 0.32's trainer factory (the installed one) with a source of vLLM 0.33's shape
    (`vllm033_weight_source`: cached_property metadata, iter_full); 0.33's runtime is not run."""
    from functools import cached_property

    from vllm033_weight_source import ParamMeta, WeightSource

    class Parameters(WeightSource):  # not vLLM's ModuleSource: read through the source adapter
        def __init__(self, model: torch.nn.Module) -> None:
            self.model = model

        @cached_property
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from ((n, p.detach()) for n, p in self.model.named_parameters())

    model = vf.load_trainer(model_dir)
    vf.perturb(model, seed=351)
    report = _send_through_vllms_client(server, model, Parameters(model))
    assert report.num_tensors == len(list(model.named_parameters()))


def _send_through_vllms_client(server: VLLMServer, model: torch.nn.Module, source: Any) -> SyncReport:
    """One `send_weights` of vLLM's trainer factory with the "weightsync" backend, through vLLM's own
    `HTTPVLLMWeightSyncClient`: verified, and the engine then serves `model` as transformers does."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm_trainer import WeightSyncTrainerInitInfo

    trainer = WeightTransferTrainerFactory.trainer_init(WeightSyncTrainerInitInfo(rank=0, transport="shm"),
                                                        client=HTTPVLLMWeightSyncClient(server.url), source=source)
    try:
        trainer.send_weights()
        report = trainer.last_report
        assert report is not None and report.verified
        vf.assert_parity(trainer.engine, model)
        return report
    finally:
        trainer.shutdown()


def test_vllm_trainer_api_over_vllms_own_http_client(server: VLLMServer, model_dir: Path) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource

    model = vf.load_trainer(model_dir)
    vf.perturb(model, seed=341)
    _send_through_vllms_client(server, model, ModuleSource(model))
