"""Streamed commits (`WeightSync(commit="streamed")`) into a real `weightsync serve`: each
bucket is written into the served parameters once its digest checks, and the served bytes
are exactly the trainer's afterwards (digests of every tensor) with transformers' own
greedy tokens and logprobs on those weights, in full mode over every transport (over shm
the parameters a staged push left on the trainer's slots are moved off them, never
written; over disk every bucket loads at the commit, read from the version directory),
delta and sparse over http. Faults in a streamed push: tests/faults/test_streamed_faults.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import weightsync as ws
from weightsync.integrity import digest
from weightsync.naming import map_names

# fixtures server, client, tiny_model, model_root, kit: tests/support/server_fixtures.py

BUCKET_BYTES = 64 << 10  # a dozen buckets for the tiny model
PROMPT = [5, 17, 42]


def _trainer(tiny_model: Path, kit: SimpleNamespace, seed: int) -> torch.nn.Module:
    return kit.load_model(tiny_model, kit.perturbed(tiny_model, seed=seed))


def _assert_serves(client: Any, kit: SimpleNamespace, model: torch.nn.Module, version: int) -> None:
    """The server serves `model`'s weights bit for bit as `version`, and generates as transformers does."""
    want = {p.hf_name: digest(p.param.detach().contiguous()) for p in map_names(model).params}
    served = client.digests()
    assert client.version() == version
    assert {n: served[n] for n in want} == want
    info = client.info()
    assert info["loading"] is None and info["refusing"] is None and not info["dirty"]
    tokens, logprobs = kit.reference_greedy(model, PROMPT, 8)
    answer = client.generate(PROMPT, return_logprob=True)
    assert answer["output_ids"] == tokens
    got = [lp[0] for lp in answer["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("transport", ["http", "shm", "disk", "broadcast"])
def test_a_streamed_full_push_serves_the_trainers_bytes(server: Any, client: Any, tiny_model: Path,
                                                        kit: SimpleNamespace, transport: str, model_root: Path) -> None:
    engine = ws.SGLangEngine(server.url)
    assert engine.capabilities(30.0).streams_commit
    options: dict[str, Any] = {"disk_root": str(model_root / "streamed")} if transport == "disk" else {}
    with ws.WeightSync([engine], transport=transport, bucket_bytes=BUCKET_BYTES, **options) as staged:
        staged.push(_trainer(tiny_model, kit, seed=1), version=(version := client.version() + 1))
    with ws.WeightSync([engine], transport=transport, bucket_bytes=BUCKET_BYTES, commit="streamed",
                       **options) as sync:
        trainer = _trainer(tiny_model, kit, seed=2)
        report = sync.push(trainer, version=(version := version + 1))
        assert report.verified and report.commit == "streamed" and report.to_dict()["commit"] == "streamed"
        assert report.num_buckets > 2
        assert report.acks[0].held_slots == {}  # written into the parameters: no received buffer is served
        _assert_serves(client, kit, trainer, version)


@pytest.mark.parametrize("mode", ["delta", "sparse"])
def test_a_streamed_partial_push_serves_the_trainers_bytes(server: Any, client: Any, tiny_model: Path,
                                                           kit: SimpleNamespace, mode: str) -> None:
    engine = ws.SGLangEngine(server.url)
    trainer = _trainer(tiny_model, kit, seed=3)
    with ws.WeightSync([engine], transport="http", bucket_bytes=BUCKET_BYTES, mode=mode, commit="streamed") as sync:
        sync.push(trainer, version=(version := client.version() + 1))  # the base this mode remembers
        params = dict(trainer.named_parameters())
        with torch.no_grad():
            params["model.layers.0.mlp.down_proj.weight"][3, :5] += 0.25
            params["lm_head.weight" if "lm_head.weight" in params else "model.embed_tokens.weight"][7, 2] -= 0.5
        report = sync.push(trainer, version=(version := version + 1))
        assert report.verified and report.mode == mode and report.commit == "streamed"
        assert report.num_tensors < len(params)  # only what changed went
        _assert_serves(client, kit, trainer, version)


def test_streamed_commit_is_refused_where_it_cannot_be_kept(server: Any) -> None:
    with pytest.raises(ValueError, match="unknown commit 'eager'"):
        ws.WeightSync([ws.SGLangEngine(server.url)], commit="eager")
    with pytest.raises(ValueError, match="commit='streamed' .* fan_out='relay'"):
        ws.WeightSync([ws.SGLangEngine(server.url)], commit="streamed", fan_out="relay")
