"""A multi-request SGLang-shaped update that is refused halfway never leaves the
engine serving a mix of two updates silently (issue 19, server/coverage.py):
`/weightsync/info` reports the partial update, a refusal of the same update marks
the engine torn, generation answers 503 until the update is completed or
reverted, and the refused request itself changed nothing."""

from __future__ import annotations

import base64
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from server_fixtures import PROMPT, halves
from weightsync.dtypes import dtype_name
from weightsync.formats.groups import UpdateGroup
from weightsync.integrity import digest

# fixtures server, client, tiny_model, model_root, kit: tests/support/server_fixtures.py

def flattened_bucket(weights: dict[str, torch.Tensor], names: list[str]) -> str:
    """SGLang's flattened bucket (uint8 buffer + byte-offset metadata), base64 pickle."""
    flat, metadata, offset = [], [], 0
    for name in names:
        raw = weights[name].flatten().view(torch.uint8)
        metadata.append({"name": name, "shape": list(weights[name].shape), "dtype": weights[name].dtype,
                         "start_idx": offset, "end_idx": offset + raw.numel(), "numel": raw.numel()})
        flat.append(raw)
        offset += raw.numel()
    bucket = {"flattened_tensor": torch.cat(flat), "metadata": metadata}
    return base64.b64encode(pickle.dumps(bucket)).decode()


def send_bucket(client: Any, weights: dict[str, torch.Tensor], names: list[str], label: str) -> Any:
    # slime's SGLangEngine.update_weights_from_tensor body (slime/backends/sglang_utils/sglang_engine.py)
    return client.post("/update_weights_from_tensor", {
        "serialized_named_tensors": [flattened_bucket(weights, names)], "load_format": "flattened_bucket",
        "flush_cache": False, "weight_version": label})


def assert_generates(client: Any, kit: SimpleNamespace, tiny_model: Path, weights: dict[str, torch.Tensor]) -> None:
    """Generation is served again, with exactly `weights` (greedy tokens equal transformers')."""
    want, _ = kit.reference_greedy(kit.load_model(tiny_model, weights), PROMPT, 8)
    got = client.generate(PROMPT, sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    assert got["output_ids"] == want


def assert_torn(client: Any, route: str) -> None:
    info = client.info()
    assert info["dirty"] is True and route in info["torn"]
    for path in ("/generate", "/health_generate"):
        response = client.post(path, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        assert response.status_code == 503, (path, response.text)
        assert route in response.json()["message"] and "resend the refused request" in response.json()["message"]


def test_slime_buckets_refused_halfway_tear_until_completed(client: Any, kit: SimpleNamespace,
                                                            tiny_model: Path) -> None:
    first, second = halves(client)
    weights = kit.perturbed(tiny_model, seed=40)
    client.ok("/pause_generation", {})  # slime: pause, flush, buckets, continue
    client.ok("/flush_cache", {})
    assert send_bucket(client, weights, first, "1").status_code == 200
    partial = client.info()
    assert partial["dirty"] is True and partial["torn"] is None  # reported, not yet refused
    assert partial["partial_update"]["label"] == "1" and partial["partial_update"]["num_missing"] == len(second)
    served = client.digests()

    bad = {**weights, second[0]: weights[second[0]][..., :1].clone()}  # a bad shape in bucket 2
    refused = send_bucket(client, bad, second, "1")
    assert refused.status_code == 400 and second[0] in refused.json()["message"]
    assert client.digests() == served  # the refusal changed nothing served
    client.ok("/continue_generation", {})
    assert_torn(client, "/update_weights_from_tensor")

    # A refusal of another label is another update: it does not untear (nor tear) anything.
    assert send_bucket(client, bad, second, "2").status_code == 400
    assert_torn(client, "/update_weights_from_tensor")

    # Resending bucket 2 completes update "1": whole again, served as sent.
    assert send_bucket(client, weights, second, "1").status_code == 200
    info = client.info()
    assert (info["dirty"], info["torn"], info["partial_update"], info["label"]) == (False, None, None, "1")
    assert client.digests() == {n: digest(t) for n, t in weights.items()}
    assert_generates(client, kit, tiny_model, weights)


def test_a_torn_engine_is_reverted_from_disk(client: Any, kit: SimpleNamespace, tiny_model: Path) -> None:
    first, _ = halves(client)
    weights = kit.perturbed(tiny_model, seed=41)
    assert send_bucket(client, weights, first, "2").status_code == 200
    assert client.post("/update_weights_from_tensor", {  # unparseable bucket 2, no label given
        "serialized_named_tensors": ["bm90IGEgcGlja2xl"], "load_format": "flattened_bucket"}).status_code == 400
    assert_torn(client, "/update_weights_from_tensor")
    client.ok("/update_weights_from_disk", {"model_path": str(tiny_model), "weight_version": "base"})
    assert client.info()["torn"] is None and client.info()["dirty"] is False
    assert_generates(client, kit, tiny_model, {})


def test_an_unauthenticated_refusal_does_not_tear(kit: SimpleNamespace, tiny_model: Path) -> None:
    for server in kit.start_server(tiny_model, "--admin-api-key", "k"):
        admin, stranger = kit.Client(server.url, admin_key="k"), kit.Client(server.url)
        try:
            first, _ = halves(admin)
            weights = kit.perturbed(tiny_model, seed=42)
            assert send_bucket(admin, weights, first, "1").status_code == 200
            assert send_bucket(stranger, weights, first, "1").status_code == 401
            assert admin.info()["torn"] is None
            admin.ok("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        finally:
            admin.close()
            stranger.close()


def test_a_refusal_inside_a_begin_end_session_tears_at_end(client: Any, kit: SimpleNamespace,
                                                           tiny_model: Path) -> None:
    first, second = halves(client)
    weights = kit.perturbed(tiny_model, seed=43)
    client.ok("/begin_weight_update", {})
    assert send_bucket(client, weights, first, "3").status_code == 200
    bad = {**weights, second[0]: weights[second[0]][..., :1].clone()}
    assert send_bucket(client, bad, second, "3").status_code == 400
    assert client.info()["torn"] is None  # nothing applied yet
    client.ok("/end_weight_update", {})  # applies bucket 1 only, as SGLang would
    assert_torn(client, "/update_weights_from_tensor")
    assert send_bucket(client, weights, second, "3").status_code == 200
    assert client.info()["torn"] is None
    assert_generates(client, kit, tiny_model, weights)


def test_slime_distributed_buckets_refused_halfway(client: Any, kit: SimpleNamespace, tiny_model: Path) -> None:
    # slime's update_weights_from_distributed body: names, dtypes, shapes, group_name, flush_cache,
    # weight_version, load_format (slime/backends/sglang_utils/sglang_engine.py).
    group_name = "slime-torn"
    group: UpdateGroup = kit.joined_group(
        lambda body: client.post("/init_weights_update_group", body), group_name,
        lambda port: {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                      "group_name": group_name, "backend": "gloo"})
    try:
        first, second = halves(client)
        weights = kit.perturbed(tiny_model, seed=44)

        def spec(names: list[str], shapes: list[list[int]] | None = None) -> dict[str, Any]:
            return {"names": names, "dtypes": [dtype_name(weights[n].dtype) for n in names],
                    "shapes": shapes or [list(weights[n].shape) for n in names], "group_name": group_name,
                    "flush_cache": False, "weight_version": "7", "load_format": "flattened_bucket"}

        with ThreadPoolExecutor(1) as pool:
            receiving = pool.submit(client.post, "/update_weights_from_distributed", spec(first))
            group.broadcast(torch.cat([weights[n].flatten().view(torch.uint8) for n in first]), src=0,
                            timeout_s=60)
            assert receiving.result().status_code == 200
        # Bucket 2 is refused before any byte moves (a negative dimension), so nothing is broadcast.
        shapes = [[-1]] + [list(weights[n].shape) for n in second[1:]]
        refused = client.post("/update_weights_from_distributed", spec(second, shapes))
        assert refused.status_code == 400 and second[0] in refused.json()["message"]
        assert_torn(client, "/update_weights_from_distributed")
        with ThreadPoolExecutor(1) as pool:
            receiving = pool.submit(client.post, "/update_weights_from_distributed", spec(second))
            group.broadcast(torch.cat([weights[n].flatten().view(torch.uint8) for n in second]), src=0,
                            timeout_s=60)
            assert receiving.result().status_code == 200
        assert client.info()["torn"] is None
        assert_generates(client, kit, tiny_model, weights)
    finally:
        client.ok("/destroy_weights_update_group", {"group_name": group_name})
        group.destroy()


def test_a_delta_is_not_applied_on_released_weights(server: Any, client: Any, kit: SimpleNamespace,
                                                    tiny_model: Path) -> None:
    # verl's colocated step with a delta-mode trainer: release the engine's weights while training
    # (/release_memory_occupation), resume them (zeros, same version), push. The version the
    # engine names is no longer what it holds, so the delta must go out whole, and be served.
    import weightsync

    model = kit.load_model(tiny_model, kit.perturbed(tiny_model, seed=43))
    sync = weightsync.WeightSync(engines=[weightsync.SGLangEngine(server.url)], transport="http", mode="delta")
    try:
        first = sync.push(model, version=client.version() + 1)
        assert first.verified and first.mode == "full"
        client.ok("/release_memory_occupation", {"tags": ["weights"]})
        client.ok("/resume_memory_occupation", {"tags": ["weights"]})
        with torch.no_grad():
            model.model.norm.weight.add_(0.25)
        second = sync.push(model, version=first.version + 1)
        assert second.verified and second.mode == "full", second
        assert client.info()["dirty"] is False and client.info()["torn"] is None
        assert_generates(client, kit, tiny_model, {n: p.detach() for n, p in model.named_parameters()})
    finally:
        sync.close()
