"""Trainer precision is not engine precision: an fp32 trainer pushes to bf16 engines.

Engines are built as the README builds them (`ws.SGLangEngine(url)`, default
options): the push learns each engine's dtype, checks that replicas agree, and
casts floating tensors bucket by bucket in the stream. What the engine then
serves equals `trainer_tensor.to(bfloat16)` bit for bit, read back over
SGLang's `/get_weights_by_name` and as digests; disagreeing replicas and casts
that overflow are refused and leave every engine on its last version.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from contract_helpers import load_trainer, next_version, perturb

import weightsync as ws
from weightsync.integrity import digest
from weightsync.server.launch import ServerProcess, launch_server
from weightsync.tiny import TinyModelConfig, make_tiny_model

TRANSPORTS = ["http", "shm", "broadcast", "disk"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same tiny model (same seed) saved in three dtypes."""
    root = tmp_path_factory.mktemp("precision")
    return {dtype: make_tiny_model(root / dtype, TinyModelConfig(dtype=dtype))
            for dtype in ("float32", "bfloat16", "float16")}


@pytest.fixture(scope="module")
def servers(model_dirs: dict[str, Path], disk_root: Path) -> Iterator[dict[str, ServerProcess]]:
    started: dict[str, ServerProcess] = {}
    try:
        for dtype, model_dir in model_dirs.items():
            started[dtype] = launch_server(model_dir, args=["--disk-root", str(disk_root)])
        yield started
    finally:
        for server in started.values():
            server.close()


def fp32_trainer(model_dirs: dict[str, Path], seed: int) -> torch.nn.Module:
    """fp32 master weights: the bf16 checkpoint loaded in float32, then a training step."""
    trainer = load_trainer(model_dirs["bfloat16"])
    assert all(p.dtype == torch.float32 for p in trainer.parameters())
    perturb(trainer, seed)
    return trainer


def served_values(url: str, name: str) -> torch.Tensor:
    """A served tensor read back whole over SGLang's own route (values as float32 lists)."""
    body = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 1 << 20}, timeout=60)
    body.raise_for_status()
    return torch.tensor(body.json(), dtype=torch.float32)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fp32_trainer_to_bf16_engine_is_bit_exact(transport: str, servers: dict[str, ServerProcess],
                                                    model_dirs: dict[str, Path], disk_root: Path) -> None:
    trainer = fp32_trainer(model_dirs, seed=len(transport))
    engine = ws.SGLangEngine(servers["bfloat16"].url)
    with ws.WeightSync(engines=[engine], transport=transport, disk_root=str(disk_root / "precision")) as sync:
        version = next_version()
        report = sync.push(trainer, version=version)
    assert report.verified and report.acks[0].version == version
    assert "cast from float32 to bfloat16" in " ".join(report.notes)
    params = dict(trainer.named_parameters())
    assert report.num_bytes == sum(p.numel() * 2 for p in params.values()), "bf16 bytes on the wire"
    want = {n: digest(p.detach().to(torch.bfloat16)) for n, p in params.items()}
    assert engine.digests() == want, "every served tensor == trainer_tensor.to(bfloat16), bit for bit"
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias", "model.norm.weight"):
        expected = params[name].detach().to(torch.bfloat16).to(torch.float32)
        got = served_values(servers["bfloat16"].url, name)
        assert torch.equal(got, expected), name
        assert not torch.equal(got, params[name].detach()), "the fp32 values were not served as they are"


def test_replicas_serving_different_dtypes_are_refused_before_any_byte_moves(
        servers: dict[str, ServerProcess], model_dirs: dict[str, Path]) -> None:
    engines = [ws.SGLangEngine(servers["bfloat16"].url), ws.SGLangEngine(servers["float32"].url)]
    before = [(e.weight_version(), e.digests()) for e in engines]
    with ws.WeightSync(engines=engines, transport="http") as sync, \
            pytest.raises(ws.CastError, match=r"replicas serve different dtypes \(http://127\.0\.0\.1:\d+ serves "
                                              r"bfloat16, http://127\.0\.0\.1:\d+ serves float32\)"):
        sync.push(fp32_trainer(model_dirs, seed=7), version=next_version())
    assert [(e.weight_version(), e.digests()) for e in engines] == before
    # an explicit dtype overrides; the fp32 replica then refuses bf16 at its dry run
    with ws.WeightSync(engines=engines, transport="http", dtype="bfloat16") as sync, \
            pytest.raises(ws.ManifestMismatchError, match="bfloat16"):
        sync.push(fp32_trainer(model_dirs, seed=7), version=next_version())
    assert [(e.weight_version(), e.digests()) for e in engines] == before


def test_a_cast_that_overflows_is_refused_and_the_engine_keeps_its_weights(
        servers: dict[str, ServerProcess], model_dirs: dict[str, Path]) -> None:
    engine = ws.SGLangEngine(servers["float16"].url)
    trainer = fp32_trainer(model_dirs, seed=8)
    with ws.WeightSync(engines=[engine], transport="http") as sync:
        good = sync.push(trainer, version=next_version())
        assert good.verified
        before = (engine.weight_version(), engine.digests())
        with torch.no_grad():
            trainer.model.layers[1].mlp.down_proj.weight[0, 0] = 1e6  # beyond float16's 65504
        with pytest.raises(ws.CastError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight' from torch\.float32 "
                                               r"to torch\.float16 overflows"):
            sync.push(trainer, version=next_version())
        assert (engine.weight_version(), engine.digests()) == before
        trainer.model.layers[1].mlp.down_proj.weight.data[0, 0] = 1.0
        assert sync.push(trainer, version=next_version()).verified  # the next push goes through


def test_an_explicit_dtype_must_be_floating(servers: dict[str, ServerProcess]) -> None:
    with pytest.raises(ValueError, match="must be a floating dtype"):
        ws.WeightSync(engines=[ws.SGLangEngine(servers["bfloat16"].url)], transport="http", dtype=torch.int8)
