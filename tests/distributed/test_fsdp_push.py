"""A 2-rank FSDP2 trainer pushing to a real `weightsync serve` engine.

Both ranks gather, rank 0 sends, both return the same report; the engine ends
up serving exactly the unsharded weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_util import init_gloo

import weightsync as ws
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


def _rank(rank: int, world_size: int, init_file: str, url: str, transport: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init_gloo(rank, world_size, init_file)
    mesh = init_device_mesh("cpu", (world_size,))
    reports = []
    with ws.WeightSync([ws.SGLangEngine(url)], transport=transport, bucket_bytes=128 << 10,
                       process_group=dist.group.WORLD, timeout_s=60) as sync:
        for version in (1, 2):
            model = trained_model(version)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            report = sync.push(model, version=version)
            assert report.verified and report.version == version
            reports.append(report.to_dict())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(reports))


@pytest.mark.parametrize("transport", ["broadcast", "http"])
def test_fsdp2_trainer_pushes_to_embedded_engine(transport: str, run_distributed, tiny_model_dir: Path,  # type: ignore[no-untyped-def]
                                                tmp_path: Path) -> None:
    with launch_server(tiny_model_dir) as server:
        run_distributed(_rank, 2, server.url, transport, str(tmp_path))
        served = ws.SGLangEngine(server.url).digests()
    expected = {n: digest(p.detach().contiguous()) for n, p in trained_model(2).named_parameters()}
    assert served == expected
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert reports[0] == reports[1], "every rank returns the sender's report"
    assert [r["version"] for r in reports[0]] == [1, 2]
