"""A Mixture-of-Experts trainer into a server that speaks only SGLang's API, as a stock
SGLang does (`weightsync serve --sglang-only`), serving the tiny Qwen3-MoE.

A stock SGLang declares nothing, so `ws.SGLangEngine` sends the checkpoint layout SGLang's
loaders read: one tensor per expert and projection (`...mlp.experts.{e}.gate_proj.weight`).
The server holds transformers' fused experts and writes each expert it receives into its
fused parameter (`weightsync.server.experts`), across buckets (broadcast: a layer's experts
span several requests) and from a disk version read as a checkpoint. Shown: after each push
the server holds the trainer's fused tensors bit for bit and serves transformers' exact
greedy tokens (float32); `/update_weights_from_disk` of the model's own `save_pretrained`
directory (per-expert names) reverts it; a whole checkpoint that lacks an expert is refused,
naming it, and the served weights stay.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

import vllm_fixtures as vf
import weightsync as ws
from moe_models import WithoutTensors, make_moe_dir
from weightsync.integrity import digest
from weightsync.server.launch import ServerProcess, launch_server

FUSED = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
         "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")


@pytest.fixture(scope="module")
def stock_moe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, ServerProcess]]:
    root = tmp_path_factory.mktemp("stock-moe")
    model_dir, disk_root = make_moe_dir(root, "qwen3_moe"), root / "versions"
    disk_root.mkdir()
    server = launch_server(model_dir, args=["--sglang-only", "--disk-root", str(root), "--num-threads", "1"])
    try:
        yield model_dir, disk_root, server
    finally:
        server.close()


def served_digest(server: ServerProcess, hf_name: str) -> str:
    """The digest of a served tensor, from SGLang's `get_weights_by_name` (its X-Weightsync-Digest header)."""
    response = httpx.post(f"{server.url}/get_weights_by_name", json={"name": hf_name, "truncate_size": 1})
    response.raise_for_status()
    return response.headers["X-Weightsync-Digest"]


def assert_holds(server: ServerProcess, trainer: torch.nn.Module) -> None:
    held = dict(trainer.named_parameters())
    for name in FUSED:
        assert served_digest(server, name) == digest(held[name].detach()), name


@pytest.mark.parametrize("transport", ["broadcast", "disk"])
def test_per_expert_pushes_land_in_the_fused_experts(stock_moe: tuple[Path, Path, ServerProcess],
                                                     transport: str) -> None:
    model_dir, disk_root, server = stock_moe
    engine = ws.SGLangEngine(server.url)
    caps = engine.capabilities(30.0)
    assert caps.expert_layout == "per-expert" and not caps.reads_digests
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=11 if transport == "broadcast" else 12)
    with ws.WeightSync([engine], transport=transport, disk_root=str(disk_root), bucket_bytes=48 << 10,
                       timeout_s=60) as sync:
        report = sync.push(trainer, version=(version := int(engine.weight_version()) + 1))
    assert not report.verified and report.num_tensors == 69 and report.num_buckets > 4
    sent = report.acks[0].loaded_names
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in sent and not sent & set(FUSED)
    assert engine.weight_version() == str(version)
    assert_holds(server, trainer)
    vf.assert_parity(engine, trainer)


def test_checkpoint_reverts_and_a_missing_expert_is_refused(stock_moe: tuple[Path, Path, ServerProcess]) -> None:
    model_dir, disk_root, server = stock_moe
    engine = ws.SGLangEngine(server.url)
    trainer = vf.load_trainer(model_dir)
    vf.perturb(trainer, seed=13)
    with ws.WeightSync([engine], transport="broadcast", timeout_s=60) as sync:
        sync.push(trainer, version=int(engine.weight_version()) + 1)
    assert_holds(server, trainer)
    # the model's own save_pretrained directory: per-expert names, read back into the fused experts
    httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": str(model_dir)},
               timeout=60).raise_for_status()
    base = vf.load_trainer(model_dir)
    assert_holds(server, base)
    vf.assert_parity(engine, base)
    # a whole version without one expert: refused naming it, the served weights stay
    lost = "model.layers.1.mlp.experts.3.down_proj.weight"
    before = engine.weight_version()
    with ws.WeightSync([engine], transport="disk", disk_root=str(disk_root), timeout_s=60) as sync, \
            pytest.raises(ws.ManifestMismatchError, match=r"lacks 1 expert tensor\(s\): 'model\.layers\.1\.mlp") \
            as refused:
        sync.push(WithoutTensors(trainer, [lost]), version=int(before) + 1)
    assert refused.value.missing == (lost,)
    assert engine.weight_version() == before
    assert_holds(server, base)


def test_a_mixtral_push_and_checkpoint_go_under_the_checkpoints_names(tmp_path: Path) -> None:
    """Mixtral's checkpoint (and so a stock SGLang's loader, and the trainer's push to it) names
    its router and experts `block_sparse_moe.` where transformers serves them as `mlp.`: the
    server maps the router as it fuses the experts, for a push and for `/update_weights_from_disk`
    of the model's `save_pretrained` directory alike."""
    model_dir = make_moe_dir(tmp_path, "mixtral")
    with launch_server(model_dir, args=["--sglang-only", "--num-threads", "1"]) as server:
        engine = ws.SGLangEngine(server.url)
        trainer = vf.load_trainer(model_dir)
        vf.perturb(trainer, seed=14)
        with ws.WeightSync([engine], transport="broadcast", timeout_s=60) as sync:
            report = sync.push(trainer, version=(version := int(engine.weight_version()) + 1))
        sent = report.acks[0].loaded_names
        assert {"model.layers.1.block_sparse_moe.gate.weight",
                "model.layers.1.block_sparse_moe.experts.7.w3.weight"} <= sent and not any(".mlp." in n for n in sent)
        assert engine.weight_version() == str(version)
        held = dict(trainer.named_parameters())
        routed = ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight", *FUSED]
        assert all(served_digest(server, name) == digest(held[name].detach()) for name in routed)
        vf.assert_parity(engine, trainer)
        httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": str(model_dir)},
                   timeout=60).raise_for_status()
        base = dict(vf.load_trainer(model_dir).named_parameters())
        assert all(served_digest(server, name) == digest(base[name].detach()) for name in routed)
