"""A 2-rank FSDP2 trainer (fp32 masters) where every rank sends its own share of each
bucket (`send_shares=True`) to two real bfloat16 `weightsync serve` engines, directly
and relayed: nothing is gathered (DTensor.full_tensor is made to fail), every push is
verified, and both engines serve exactly the unsharded weights cast to bfloat16. A share
corrupted in transit is refused by the engine, the push fails on every rank naming the
rank, both engines keep their version, and the next push succeeds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import weightsync as ws
from dist_util import init_gloo
from serve_check import launch_servers
from weightsync.integrity import digest
from weightsync.tiny import TinyModelConfig, build_model, make_tiny_model

CFG = TinyModelConfig(num_layers=2)
BUCKET_BYTES = 96 << 10


def _sharded_model(rank: int, world_size: int, step: int) -> torch.nn.Module:
    """An FSDP2 model with fp32 parameters after `step` real AdamW steps (the same on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    model = build_model(CFG)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(step):
        ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(100 * s + rank))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _no_gather(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise AssertionError("send_shares gathered a DTensor")


def _expected(model: torch.nn.Module) -> dict[str, str]:
    return {n: digest(p.full_tensor().detach().to(torch.bfloat16)) for n, p in model.named_parameters()}


def _push(urls: list[str], model: torch.nn.Module, version: int, fan_out: str) -> dict[str, Any]:
    """A push in shares with no DTensor gathered."""
    from torch.distributed.tensor import DTensor

    full_tensor = DTensor.full_tensor
    DTensor.full_tensor = _no_gather  # type: ignore[method-assign]
    try:
        with ws.WeightSync([ws.SGLangEngine(u) for u in urls], transport="http", bucket_bytes=BUCKET_BYTES,
                           process_group=dist.group.WORLD, send_shares=True, fan_out=fan_out, timeout_s=60) as sync:
            return sync.push(model, version=version).to_dict()
    finally:
        DTensor.full_tensor = full_tensor  # type: ignore[method-assign]


def _rank(rank: int, world_size: int, init_file: str, urls: list[str], out_dir: str) -> None:
    """v1 direct, v2 relayed; v3 with rank 1's shares flipped in one byte after their digest
    was taken (in transit), which must fail; v4."""
    from weightsync.formats.shares import Share

    init_gloo(rank, world_size, init_file)
    out: dict[str, Any] = {"reports": {}}
    for version, fan_out in ((1, "direct"), (2, "relay")):
        out["reports"][fan_out] = _push(urls, _sharded_model(rank, world_size, version), version, fan_out)
    payload = Share.payload
    if rank == 1:
        def corrupted(self: Share) -> list[memoryview]:
            table, data = payload(self)
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0x10
            return [table, memoryview(bytes(flipped))]

        Share.payload = corrupted  # type: ignore[method-assign]
    try:
        _push(urls, _sharded_model(rank, world_size, 3), 3, "relay")
    except ws.WeightSyncError as e:
        out["error"] = str(e)
    Share.payload = payload  # type: ignore[method-assign]
    out["kept"] = [ws.SGLangEngine(u).weight_version() for u in urls]
    model = _sharded_model(rank, world_size, 4)
    out["reports"]["after"] = _push(urls, model, 4, "direct")
    out["expected"] = _expected(model)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def test_every_rank_sends_its_share_directly_and_relayed(run_distributed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    engine_dir = make_tiny_model(tmp_path / "bf16", TinyModelConfig(num_layers=2, dtype="bfloat16"))
    with launch_servers(engine_dir, 2) as (first, second):
        run_distributed(_rank, 2, [first.url, second.url], str(tmp_path))
        served = [ws.SGLangEngine(s.url).digests() for s in (first, second)]
        versions = [ws.SGLangEngine(s.url).weight_version() for s in (first, second)]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["reports"] == ranks[1]["reports"], "every rank returns the sender's report"
    reports = ranks[0]["reports"]
    nbytes = sum(p.numel() * 2 for p in build_model(CFG).parameters())
    for name in ("direct", "relay", "after"):
        assert reports[name]["verified"] and reports[name]["num_bytes"] == nbytes and reports[name]["num_buckets"] > 2
        assert all(len(a["digests"]) == reports[name]["num_buckets"] for a in reports[name]["acks"])
    for r in ranks:
        assert "trainer rank 1" in r["error"] and "corrupted" in r["error"], r["error"]
        assert r["kept"] == ["2", "2"], "a failed push leaves both engines on their last version"
    assert versions == ["4", "4"]
    assert served[0] == ranks[0]["expected"] and served[1] == ranks[0]["expected"], \
        "fp32 shards cast to bfloat16, bit for bit"
