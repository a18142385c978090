"""A 2-rank FSDP2 trainer pushing to a real `weightsync serve` engine.

Both ranks gather, rank 0 sends, both return the same report; the engine ends
up serving exactly the unsharded weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import weightsync as ws
from dist_util import init_gloo
from weightsync.integrity import digest
from weightsync.server.launch import launch_server
from weightsync.tiny import TinyModelConfig, build_model

CFG = TinyModelConfig(num_layers=2)


def trained_model(step: int) -> torch.nn.Module:
    """The same weights on every rank and in the parent: a model after `step` fake steps."""
    model = build_model(CFG)
    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


TRANSPORTS = ("broadcast", "http")
"""Pushed one after the other by the same ranks (a spawn costs seconds): versions 1-2, then 3-4."""


def _rank(rank: int, world_size: int, init_file: str, url: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init_gloo(rank, world_size, init_file)
    mesh = init_device_mesh("cpu", (world_size,))
    reports: dict[str, list[dict]] = {}
    served: dict[str, dict[str, str]] = {}
    for first, transport in zip((1, 3), TRANSPORTS, strict=True):
        with ws.WeightSync([ws.SGLangEngine(url)], transport=transport, bucket_bytes=128 << 10,
                           process_group=dist.group.WORLD, timeout_s=60) as sync:
            for version in (first, first + 1):
                model = trained_model(version)
                for layer in model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
                report = sync.push(model, version=version)
                assert report.verified and report.version == version
                reports.setdefault(transport, []).append(report.to_dict())
        served[transport] = ws.SGLangEngine(url).digests()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"reports": reports, "served": served}))


def test_fsdp2_trainer_pushes_to_embedded_engine(run_distributed, tiny_model_dir: Path,  # type: ignore[no-untyped-def]
                                                tmp_path: Path) -> None:
    """Over broadcast, then over http: after each, the engine serves the unsharded weights."""
    with launch_server(tiny_model_dir) as server:
        run_distributed(_rank, 2, server.url, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["reports"] == ranks[1]["reports"], "every rank returns the sender's report"
    for first, transport in zip((1, 3), TRANSPORTS, strict=True):
        expected = {n: digest(p.detach().contiguous()) for n, p in trained_model(first + 1).named_parameters()}
        assert ranks[0]["served"][transport] == expected, transport
        assert [r["version"] for r in ranks[0]["reports"][transport]] == [first, first + 1]


def _rank_mixed_precision(rank: int, world_size: int, init_file: str, url: str, out_dir: str) -> None:
    """FSDP2 with fp32 parameters and bf16 compute (MixedPrecisionPolicy), one real training
    step, then a push with the README's defaults to an engine that serves bfloat16."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    init_gloo(rank, world_size, init_file)
    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = build_model(CFG)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert all(p.to_local().dtype == torch.float32 for p in model.parameters()), "fp32 master shards"
    with ws.WeightSync([ws.SGLangEngine(url)], transport="http", process_group=dist.group.WORLD) as sync:
        report = sync.push(model, version=1)
    assert report.verified and report.num_bytes == sum(p.numel() * 2 for p in model.parameters())
    expected = {n: digest(p.full_tensor().detach().to(torch.bfloat16)) for n, p in model.named_parameters()}
    if rank == 0:
        Path(out_dir, "expected.json").write_text(json.dumps(expected))


def test_fsdp2_fp32_master_weights_push_to_a_bf16_engine(run_distributed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from weightsync.tiny import make_tiny_model

    engine_dir = make_tiny_model(tmp_path / "bf16", TinyModelConfig(num_layers=2, dtype="bfloat16"))
    with launch_server(engine_dir) as server:
        run_distributed(_rank_mixed_precision, 2, server.url, str(tmp_path))
        served = ws.SGLangEngine(server.url).digests()
    expected = json.loads((tmp_path / "expected.json").read_text())
    assert served == expected, "the engine serves the gathered fp32 weights cast to bfloat16, bit for bit"
