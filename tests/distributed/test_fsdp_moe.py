"""A 2-rank FSDP2 Mixture-of-Experts trainer (the tiny Qwen3-MoE of transformers 5, its fused
3-D expert parameters sharded by `fully_shard`) pushes bit-equal to the single-process push.

Fused layout (`weightsync serve`): the FSDP2 push and then the single-process push of the
same weights, with the same buckets, are acked with the same bucket digests, and the engine
serves the same tensors after each (and not what it served before). Per-expert layout (what
vLLM and SGLang load): every rank streams the checkpoint tensors weightsync sends such an
engine (`named_weights(..., expert_layout="per-expert")`, the stream a push reads, one
all-gather per fused parameter), and their digests equal the single-process stream's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import weightsync as ws
from dist_util import init_gloo
from weightsync.integrity import digest
from weightsync.server.launch import launch_server
from weightsync.tiny import TinyModelConfig, build_model, make_tiny_model

CFG = TinyModelConfig(arch="qwen3_moe")
"""2 layers of 8 experts: gate_up_proj [8, 128, 64] and down_proj [8, 64, 64] per layer."""
BUCKET_BYTES = 256 << 10


def trained_moe() -> torch.nn.Module:
    """The same weights on every rank and in the parent: the tiny Qwen3-MoE after a fake step."""
    model = build_model(CFG)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def per_expert_digests(model: torch.nn.Module) -> dict[str, str]:
    """Digest of every checkpoint tensor weightsync sends a per-expert engine (FSDP2: every rank calls it)."""
    return {name: digest(t.contiguous()) for name, t in ws.named_weights(model, expert_layout="per-expert")}


def _rank(rank: int, world_size: int, init_file: str, url: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    init_gloo(rank, world_size, init_file)
    mesh = init_device_mesh("cpu", (world_size,))
    model = trained_moe()
    for layer in model.model.layers:
        fully_shard(layer.mlp.experts, mesh=mesh)  # the 3-D expert parameters, sharded by expert rows
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj
    assert isinstance(gate_up, DTensor) and gate_up.to_local().shape[0] == 4, "4 of 8 experts per rank"
    with ws.WeightSync([ws.SGLangEngine(url)], transport="http", bucket_bytes=BUCKET_BYTES,
                       process_group=dist.group.WORLD, timeout_s=60) as sync:
        report = sync.push(model, version=1)
    assert report.verified
    streamed = per_expert_digests(model)
    if rank == 0:
        Path(out_dir, "fsdp.json").write_text(json.dumps({"report": report.to_dict(), "per_expert": streamed}))


def test_fsdp2_moe_push_is_bit_equal_to_the_single_process_push(run_distributed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model_dir = make_tiny_model(tmp_path / "qwen3-moe", CFG)
    with launch_server(model_dir, args=["--num-threads", "1"]) as server:
        engine = ws.SGLangEngine(server.url)
        before = engine.digests()
        run_distributed(_rank, 2, server.url, str(tmp_path))
        after_fsdp = engine.digests()
        single = trained_moe()
        with ws.WeightSync([engine], transport="http", bucket_bytes=BUCKET_BYTES, timeout_s=60) as sync:
            report = sync.push(single, version=2)
        assert report.verified
        after_single = engine.digests()
    fsdp = json.loads((tmp_path / "fsdp.json").read_text())
    fsdp_report = ws.SyncReport.from_dict(fsdp["report"])
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert fused in fsdp_report.acks[0].loaded_names and fsdp_report.num_tensors == report.num_tensors == 25
    assert fsdp_report.num_buckets == report.num_buckets > 1
    assert fsdp_report.acks[0].digests == report.acks[0].digests, "the same bytes in the same buckets"
    assert after_fsdp == after_single == {n: digest(p.detach()) for n, p in single.named_parameters()}
    assert after_fsdp[fused] != before[fused]
    # per-expert: 2 layers x 8 experts x (gate, up, down) checkpoint tensors, plus the 21 others
    single_stream = per_expert_digests(single)
    assert len(single_stream) == 48 + 21 and "model.layers.1.mlp.experts.7.up_proj.weight" in single_stream
    assert fsdp["per_expert"] == single_stream
