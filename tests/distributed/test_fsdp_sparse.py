"""mode="sparse" from a 3-rank FSDP2 trainer (fp32 masters, real AdamW steps) into a
real bf16 `weightsync serve` engine, with the README's defaults otherwise.

Three ranks shard every dim 0 unevenly (128 rows: 43, 43, 42), so rows start at
byte offsets that split 8-byte words between ranks (the whole-tensor digests are
combined across them). Each rank diffs its own rows; the test counts
`DTensor.full_tensor` calls on every rank: none, in any push, sparse or not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import weightsync as ws
from dist_util import init_gloo
from weightsync.integrity import digest
from weightsync.server.launch import launch_server
from weightsync.tiny import TinyModelConfig, build_model, make_tiny_model

CFG = TinyModelConfig(num_layers=2)
WORLD_SIZE = 3
LR = 1e-5
"""AdamW moves each weight by about LR per step: a few percent of the bf16 elements change."""


def _count_full_tensor_calls() -> list[int]:
    """Count DTensor.full_tensor calls in this process (the all-gathers of whole weights)."""
    from torch.distributed.tensor import DTensor

    calls = [0]
    original = DTensor.full_tensor

    def counted(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return original(self, *args, **kwargs)

    DTensor.full_tensor = counted  # type: ignore[method-assign]
    return calls


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _rank(rank: int, world_size: int, init_file: str, url: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init_gloo(rank, world_size, init_file)
    mesh = init_device_mesh("cpu", (world_size,))
    model = build_model(CFG)  # the same fp32 weights on every rank
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    full_tensor_calls = _count_full_tensor_calls()
    engine = ws.SGLangEngine(url)
    out: dict[str, Any] = {"reports": []}

    def push(sync: ws.WeightSync, version: int) -> None:
        before = full_tensor_calls[0]
        report = sync.push(model, version=version)
        out["reports"].append({**report.to_dict(), "full_tensor_calls": full_tensor_calls[0] - before})

    with ws.WeightSync([engine], mode="sparse", process_group=dist.group.WORLD) as sync:
        push(sync, 1)  # nothing acked yet: whole
        for version in (2, 3):
            _train_step(model, optimizer, rank, version)
            push(sync, version)
        if rank == 0:  # another trainer moves the engine off v3: the next sparse push is refused
            with ws.WeightSync([engine], mode="full") as other:
                other.push(build_model(TinyModelConfig(num_layers=2, seed=5)), version=4)
        _train_step(model, optimizer, rank, 5)
        push(sync, 5)  # refused (409: the engine holds the other v4), sent whole, every rank streaming along
        _train_step(model, optimizer, rank, 6)
        push(sync, 6)  # sparse again, on top of v5
        out["served_after_6"] = engine.digests() if rank == 0 else None
        out["expected"] = {n: digest(p.full_tensor().detach().to(torch.bfloat16)) for n, p in model.named_parameters()}
        if rank == world_size - 1:  # one value on the last rank's rows that rounds to inf in bf16
            with torch.no_grad():
                model.model.layers[1].mlp.down_proj.weight.to_local()[-1, 0] = torch.finfo(torch.float32).max
        try:
            sync.push(model, version=7)
        except ws.WeightSyncError as e:
            out["error_7"] = f"{type(e).__name__}: {e}"
        out["version_after_7"] = engine.weight_version() if rank == 0 else None
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def test_fsdp2_sparse_push_diffs_each_ranks_rows(run_distributed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    engine_dir = make_tiny_model(tmp_path / "bf16", TinyModelConfig(num_layers=2, dtype="bfloat16"))
    with launch_server(engine_dir) as server:
        run_distributed(_rank, WORLD_SIZE, server.url, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    reports = ranks[0]["reports"]
    assert all(r["reports"] == reports for r in ranks), "every rank returns the sender's reports"
    assert [r["version"] for r in reports] == [1, 2, 3, 5, 6]
    assert all(r["verified"] for r in reports)
    assert [r["mode"] for r in reports] == ["full", "sparse", "sparse", "full", "sparse"]
    assert all(r["full_tensor_calls"] == 0 for r in reports), "no rank gathered a whole fp32 weight"
    full_bytes = reports[0]["num_bytes"]
    assert full_bytes == sum(p.numel() * 2 for p in build_model(CFG).parameters())
    for sparse in (reports[1], reports[2], reports[4]):
        encodings = sparse["encodings"]
        assert set(encodings) & {"positions16", "positions32", "bitmap"}, encodings
        assert sparse["num_skipped"] > 0, "the norms' bf16 values do not move at this learning rate"
        assert sparse["num_bytes"] < 0.5 * full_bytes, (sparse["num_bytes"], full_bytes)
    # the engine serves the trainer's v6 bit for bit: every rank's changes, in their places
    assert ranks[0]["served_after_6"] == ranks[0]["expected"]
    # an overflow on rank 2's rows fails the push on every rank; the engine stays on v6
    assert "CastError" in ranks[0]["error_7"] and "trainer rank 2" in ranks[0]["error_7"], ranks[0]["error_7"]
    assert all("the sending trainer rank failed" in r["error_7"] for r in ranks[1:])
    assert ranks[0]["version_after_7"] == "6"
