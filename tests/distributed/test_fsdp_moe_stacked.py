"""A 2-rank FSDP2 trainer holding its experts one by one (the transformers 4 layout,
`moe_models.per_expert_trainer`, every per-expert weight sharded by rows) pushes into
`weightsync serve`, which loads them fused: each fused tensor is stacked from the per-expert
parameters, each gathered as it is packed (every rank gathers the same parts in the same
order). The served tensors are the equivalent fused trainer's parameters bit for bit, after a
full push and after a delta that edits two experts, which sends only their layer's two fused
tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import weightsync as ws
from dist_util import init_gloo
from moe_models import edit_two_experts, per_expert_trainer
from weightsync.integrity import digest
from weightsync.server.launch import launch_server
from weightsync.tiny import TinyModelConfig, build_model, make_tiny_model

CFG = TinyModelConfig(arch="qwen3_moe")
BUCKET_BYTES = 256 << 10
FUSED_OF_LAYER_1 = {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}


def trained_moe(*, edited: bool = False) -> torch.nn.Module:
    """The same fused weights on every rank and in the parent; `edited`: then two experts of layer 1 changed."""
    model = build_model(CFG)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    if edited:
        edit_two_experts(model, layer=1)
    return model


def _rank(rank: int, world_size: int, init_file: str, url: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    init_gloo(rank, world_size, init_file)
    mesh = init_device_mesh("cpu", (world_size,))
    model = per_expert_trainer(trained_moe())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gate = model.model.layers[0].mlp.experts[0].gate_proj.weight
    assert isinstance(gate, DTensor) and gate.to_local().shape[0] == gate.shape[0] // 2, "rows sharded"
    engine = ws.SGLangEngine(url)
    with ws.WeightSync([engine], transport="http", bucket_bytes=BUCKET_BYTES, mode="delta",
                       process_group=dist.group.WORLD, timeout_s=60) as sync:
        first = sync.push(model, version=1)
        served_first = engine.digests() if rank == 0 else None
        edited = dict(per_expert_trainer(trained_moe(edited=True)).named_parameters())
        changed = []
        with torch.no_grad():
            for name, param in model.named_parameters():
                if not torch.equal(param.full_tensor(), edited[name]):
                    changed.append(name)
                    param.to_local().copy_(edited[name].chunk(world_size)[rank])
        second = sync.push(model, version=2)
    assert first.verified and second.verified
    if rank == 0:
        Path(out_dir, "fsdp.json").write_text(json.dumps({
            "first": first.to_dict(), "second": second.to_dict(), "served_first": served_first,
            "changed": changed}))


def test_fsdp2_per_expert_trainer_is_served_as_the_fused_one(run_distributed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model_dir = make_tiny_model(tmp_path / "qwen3-moe", CFG)
    with launch_server(model_dir, args=["--num-threads", "1"]) as server:
        engine = ws.SGLangEngine(server.url)
        run_distributed(_rank, 2, server.url, str(tmp_path))
        served = engine.digests()
        assert engine.weight_version() == "2"
    out = json.loads((tmp_path / "fsdp.json").read_text())
    first, second = ws.SyncReport.from_dict(out["first"]), ws.SyncReport.from_dict(out["second"])
    assert first.num_tensors == 25 and first.num_buckets > 1 and first.acks[0].loaded_names >= FUSED_OF_LAYER_1
    assert out["served_first"] == {n: digest(p.detach()) for n, p in trained_moe().named_parameters()}
    assert sorted(out["changed"]) == sorted(f"model.layers.1.mlp.experts.{e}.{p}_proj.weight"
                                            for e in (2, 5) for p in ("gate", "up", "down"))
    assert second.mode == "delta" and second.acks[0].loaded_names == FUSED_OF_LAYER_1, second.acks[0]
    assert served == {n: digest(p.detach()) for n, p in trained_moe(edited=True).named_parameters()}
