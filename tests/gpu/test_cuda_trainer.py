"""A trainer on a CUDA device pushing into `weightsync serve` (the engine on the host's CPU),
through `WeightSync.push` as the README writes it. Runs where CUDA is present (a lent GPU
machine); skipped, with the reason, everywhere else.

Shown: float32 Mixture-of-Experts masters on the GPU (Qwen3-MoE: fused experts; GLM-4-MoE:
the router's float32 bias) reach a bfloat16 engine cast on the device, bucket by bucket,
over http, shm and a gloo broadcast group (host buckets: each tensor cast where it lives,
then copied into its bucket). Every push is verified and the engine's served digests equal
the trainer's tensors cast to bfloat16 on the CPU, byte for byte (the router bias: float32,
exact). Run on an H200 (torch 2.11+cu130): http and shm passed for both models; the
broadcast case ran then with buckets on the GPU, which gloo refused ("No backend type
associated with device type cuda"; `BroadcastTransport` now refuses that pairing when built)
and NCCL hung (trainer and engine on one GPU), so it runs here with host buckets, not yet
run on a GPU. docs/TESTING.md says how to run this module on a lent GPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import weightsync as ws
from moe_models import make_moe_dir
from weightsync.integrity import digest
from weightsync.server.launch import ServerProcess, launch_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def bf16_serve(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[Path, ServerProcess]]:
    model_dir = make_moe_dir(tmp_path_factory.mktemp("cuda-moe"), request.param, dtype="bfloat16")
    server = launch_server(model_dir, args=["--num-threads", "4"])
    try:
        yield model_dir, server
    finally:
        server.close()


def cuda_trainer(model_dir: Path, seed: int) -> torch.nn.Module:
    """The checkpoint as float32 masters on the GPU, every tensor moved off bfloat16's grid."""
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for tensor in trainer.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape, generator=gen, device="cuda") * 1e-2 + 1e-3 / 3)
    return trainer


def expected_digests(trainer: torch.nn.Module, kept: set[str], served: set[str]) -> dict[str, str]:
    """What the engine must serve, computed on the CPU: bfloat16 casts, `kept` in float32."""
    return {n: digest(t.detach().cpu() if n in kept else t.detach().cpu().to(torch.bfloat16).contiguous())
            for n, t in trainer.state_dict().items() if n in served}


@pytest.mark.parametrize("transport", ["http", "shm", "broadcast"])
def test_cuda_fp32_moe_masters_reach_a_bf16_engine_exactly(bf16_serve: tuple[Path, ServerProcess],
                                                           transport: str) -> None:
    model_dir, server = bf16_serve
    engine = ws.SGLangEngine(server.url)
    kept = set(engine.capabilities(30.0).kept_dtypes)
    trainer = cuda_trainer(model_dir, seed=len(transport))
    with ws.WeightSync([engine], transport=transport, timeout_s=30) as sync:
        report = sync.push(trainer, version=(version := int(engine.weight_version()) + 1))
    assert report.verified and engine.weight_version() == str(version), report
    assert any("cast from float32 to bfloat16" in n for n in report.notes), report.notes
    served = engine.digests()
    assert served == expected_digests(trainer, kept, set(served))
    print(f"\n{model_dir.name} over {transport}: {report.num_tensors} tensors, {report.num_bytes} bytes, "
          f"{report.seconds * 1e3:.1f} ms, stages {report.stages}")
