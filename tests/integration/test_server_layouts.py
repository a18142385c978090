"""A real `weightsync serve` remembers the layouts it began (`weightsync.server.layouts`): a trainer's
next push of the same plan names its layout instead of sending the manifest, and every push
is verified as before; after a restart, or a change of layout, the manifest goes whole; a
refused manifest's layout is never remembered."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import torch

import weightsync as ws
from weightsync.integrity import digest
from weightsync.manifest import Manifest, TensorMeta
from weightsync.naming import map_names

# fixtures server, client, tiny_model, kit: tests/support/server_fixtures.py

BUCKET_BYTES = 64 << 10  # a dozen buckets for the tiny model


def _trainer(tiny_model: Path, kit: SimpleNamespace, seed: int) -> torch.nn.Module:
    return kit.load_model(tiny_model, kit.perturbed(tiny_model, seed=seed))


def _weights(model: torch.nn.Module) -> dict[str, str]:
    """Digests of the trainer's weights as a float32 engine serves them."""
    return {p.hf_name: digest(p.param.detach().contiguous()) for p in map_names(model).params}


def _served(client: Any, model: torch.nn.Module, version: int) -> bool:
    want = _weights(model)
    served = client.digests()
    return client.version() == version and {n: served[n] for n in want} == want


def test_a_push_of_a_layout_the_engine_remembers_names_it(server: Any, client: Any, tiny_model: Path,
                                                           kit: SimpleNamespace) -> None:
    engine = ws.SGLangEngine(server.url)
    before = client.info()["layouts"]
    with ws.WeightSync([engine], transport="shm", bucket_bytes=BUCKET_BYTES) as sync:
        for seed in (21, 22, 23):  # one plan, other weights each step
            model = _trainer(tiny_model, kit, seed)
            version = client.version() + 1
            report = sync.push(model, version=version)
            assert report.verified and report.num_buckets > 1
            assert _served(client, model, version)
    after = client.info()["layouts"]
    assert after["begins_whole"] == before["begins_whole"] + 1
    assert after["begins_by_layout"] == before["begins_by_layout"] + 2
    assert after["unknown"] == before["unknown"]
    layout = after["remembered"][-1]

    # another bucket size is another layout: sent whole, then named
    with ws.WeightSync([engine], transport="shm", bucket_bytes=BUCKET_BYTES * 4) as sync:
        for seed in (24, 25):
            model = _trainer(tiny_model, kit, seed)
            version = client.version() + 1
            assert sync.push(model, version=version).verified
            assert _served(client, model, version)
    last = client.info()["layouts"]
    assert last["begins_whole"] == after["begins_whole"] + 1
    assert last["begins_by_layout"] == after["begins_by_layout"] + 1
    assert last["remembered"][-2:] == [layout, last["remembered"][-1]] and last["remembered"][-1] != layout


def test_an_engine_that_restarted_gets_the_manifest_whole(tiny_model: Path, kit: SimpleNamespace) -> None:
    first = kit.start_server(tiny_model)
    server = next(first)
    port = urlparse(server.url).port
    engine = ws.SGLangEngine(server.url)
    with ws.WeightSync([engine], transport="http", bucket_bytes=BUCKET_BYTES) as sync:
        client = kit.Client(server.url)
        try:
            for version, seed in ((1, 31), (2, 32)):
                assert sync.push(_trainer(tiny_model, kit, seed), version=version).verified
            assert client.info()["layouts"]["begins_by_layout"] == 1
        finally:
            client.close()
        first.close()  # stopped: it remembers nothing when it starts again

        second = kit.start_server(tiny_model, "--port", str(port))
        restarted = next(second)
        assert restarted.url == server.url
        client = kit.Client(restarted.url)
        try:
            model = _trainer(tiny_model, kit, 33)
            report = sync.push(model, version=1)  # named its layout, told it is unknown, sent it whole
            assert report.verified
            assert _served(client, model, 1)
            layouts = client.info()["layouts"]
            assert (layouts["unknown"], layouts["begins_whole"], layouts["begins_by_layout"]) == (1, 1, 0)
            model = _trainer(tiny_model, kit, 34)
            assert sync.push(model, version=2).verified  # and named again
            assert _served(client, model, 2)
            assert client.info()["layouts"]["begins_by_layout"] == 1
        finally:
            client.close()
            second.close()


def test_a_refused_manifests_layout_is_never_remembered(client: Any, tiny_model: Path,
                                                         kit: SimpleNamespace) -> None:
    version = client.version()
    weights = kit.perturbed(tiny_model, seed=41)
    good, _ = kit.make_update(weights, version=version + 1, bucket_bytes=BUCKET_BYTES)
    answer = client.ok("/weightsync/begin", {"manifest": good.without_digests().to_dict()})
    assert answer["layout"] == good.layout_digest  # the engine's digest of what it parsed: the trainer's
    client.ok("/weightsync/abort", {"version": version + 1})

    # one tensor of another shape: refused naming it, and its layout not remembered
    wrong_metas = [TensorMeta(hf_name=e.hf_name, dtype=e.dtype,
                              shape=(e.shape[0] + 1, *e.shape[1:]) if e.hf_name == "model.norm.weight" else e.shape)
                   for e in good.entries()]
    wrong = Manifest(version=version + 1, buckets=ws.plan_buckets(wrong_metas, BUCKET_BYTES))
    refused = client.post("/weightsync/begin", {"manifest": wrong.to_dict()})
    assert refused.status_code in (400, 409, 422), refused.text
    assert "model.norm.weight" in refused.json()["mismatched"]
    by_layout = {"manifest": wrong.to_dict(buckets=False), "layout": wrong.layout_digest,
                 "digests": [None] * len(wrong.buckets)}
    unknown = client.post("/weightsync/begin", by_layout)
    assert unknown.status_code == 409
    assert unknown.json()["unknown_layout"] == wrong.layout_digest
    assert client.info()["session"] is None and client.version() == version

    # the remembered good layout, named with the right version: begun, as a whole begin would be
    named = client.ok("/weightsync/begin", {"manifest": good.to_dict(buckets=False), "layout": good.layout_digest,
                                            "digests": list(good.digests)})
    assert named["layout"] == good.layout_digest
    assert client.info()["session"]["version"] == version + 1
    client.ok("/weightsync/abort", {"version": version + 1})
    assert client.version() == version
