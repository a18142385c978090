"""Bad input never crashes the server or changes what it serves.

Each refusal is a 4xx JSON answer naming the offender; afterwards the served
weights are bit-identical (digests) and the version is unchanged. The server
runs with an admin key, which every mutating route enforces.
"""

from __future__ import annotations

import base64
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from weightsync.formats.version_dir import bucket_file_name

# fixtures tiny_model, model_root, kit, one_torch_thread: tests/support/server_fixtures.py

KEY = "s3cret-admin-key"
MUTATING = [
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weight_version",
    "/begin_weight_update",
    "/end_weight_update",
    "/pause_generation",
    "/continue_generation",
    "/weightsync/begin",
    "/weightsync/bucket",
    "/weightsync/shm_bucket",
    "/weightsync/receive",
    "/weightsync/commit",
    "/weightsync/abort",
    "/weightsync/rollback",
    "/load_lora_adapter",
    "/load_lora_adapter_from_tensors",
    "/unload_lora_adapter",
]


@pytest.fixture(scope="module")
def server(tiny_model: Path, kit: SimpleNamespace, one_torch_thread: None) -> Iterator[Any]:
    yield from kit.start_server(tiny_model, "--admin-api-key", KEY)


@pytest.fixture(scope="module")
def client(server: Any, kit: SimpleNamespace) -> Iterator[Any]:
    client = kit.Client(server.url, admin_key=KEY)
    yield client
    client.close()


@pytest.fixture(scope="module")
def initial(client: Any) -> tuple[int, dict[str, str]]:
    return client.version(), client.digests()


@pytest.fixture(autouse=True)
def served_weights_unchanged(client: Any, initial: tuple[int, dict[str, str]]) -> Iterator[None]:
    yield
    client.post("/weightsync/abort", {})  # leave no session behind
    assert (client.version(), client.digests()) == initial


def refused(response: Any, status: int, *needles: str) -> dict[str, Any]:
    """Assert a JSON refusal with `status` whose message names every needle."""
    assert response.status_code == status, f"{response.status_code}: {response.text}"
    body = response.json()
    assert body["success"] is False
    for needle in needles:
        assert needle in body["message"], f"{needle!r} not in {body['message']!r}"
    return body


def serialized(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def test_admin_key_is_required_on_mutating_routes(server: Any, kit: SimpleNamespace) -> None:
    anonymous, wrong = kit.Client(server.url), kit.Client(server.url, admin_key="wrong")
    try:
        for route in MUTATING:
            refused(anonymous.post(route, {}), 401, "admin key")
            refused(wrong.post(route, {}), 401, "admin key")
        # Reading and generating need no key.
        assert anonymous.http.get("/health").status_code == 200
        assert anonymous.http.get("/weightsync/info").status_code == 200
        assert anonymous.post("/weightsync/digests", {}).status_code == 200
        assert anonymous.generate([1, 2, 3])["meta_info"]["completion_tokens"] > 0
    finally:
        anonymous.close()
        wrong.close()


def test_unknown_name_shape_and_dtype_mismatch_over_tensors(client: Any, tiny_model: Path,
                                                            kit: SimpleNamespace) -> None:
    good = kit.perturbed(tiny_model, seed=60, names=["model.norm.weight"])
    norm = good["model.norm.weight"]
    cases = [
        ([("model.norm.weight", norm), ("model.no_such.weight", norm)], "model.no_such.weight"),
        ([("model.norm.weight", norm[:-1])], "model.norm.weight"),
        ([("model.norm.weight", norm.to(torch.bfloat16))], "bfloat16"),
    ]
    for pairs, needle in cases:
        refused(client.post("/update_weights_from_tensor", {"serialized_named_tensors": [serialized(pairs)]}),
                400, needle)


def test_manifest_mismatches_are_refused_at_begin(client: Any, tiny_model: Path, kit: SimpleNamespace) -> None:
    weights = kit.perturbed(tiny_model, seed=61)
    version = client.version() + 1
    partial = {n: t for n, t in weights.items() if n != "lm_head.weight"}
    manifest, _ = kit.make_update(partial, version=version)
    body = refused(client.post("/weightsync/begin", {"manifest": manifest.to_dict()}), 400, "lm_head.weight")
    assert body["missing"] == ["lm_head.weight"]

    wrong = dict(weights)
    wrong["model.norm.weight"] = weights["model.norm.weight"].double()
    wrong["model.extra.weight"] = torch.zeros(3)
    manifest, _ = kit.make_update(wrong, version=version)
    body = refused(client.post("/weightsync/begin", {"manifest": manifest.to_dict()}), 400, "model.extra.weight")
    assert body["unexpected"] == ["model.extra.weight"] and body["mismatched"] == ["model.norm.weight"]

    refused(client.post("/weightsync/begin", {"manifest": {"format": "nope"}}), 400, "manifest")


def test_versions_must_increase(client: Any, tiny_model: Path, kit: SimpleNamespace) -> None:
    current = client.version()
    weights = kit.perturbed(tiny_model, seed=62)
    manifest, _ = kit.make_update(weights, version=current)
    refused(client.post("/weightsync/begin", {"manifest": manifest.to_dict()}), 409, "not newer")
    # SGLang's weight_version is a label (any string), never a version to compare; only its type is checked.
    pairs = [("model.norm.weight", weights["model.norm.weight"])]
    refused(client.post("/update_weights_from_tensor", {"serialized_named_tensors": [serialized(pairs)],
                                                        "weight_version": ["v7"]}), 400, "'weight_version'", "string")
    refused(client.post("/update_weight_version", {"new_version": 7.5}), 400, "'new_version'", "string")
    refused(client.post("/update_weight_version", {}), 400, "new_version")
    delta, _ = kit.make_update({"model.norm.weight": weights["model.norm.weight"]}, version=current + 1,
                              mode="delta", base_version=current + 100)
    refused(client.post("/weightsync/begin", {"manifest": delta.to_dict()}), 409, "full update")


def test_bad_bucket_frames(client: Any, tiny_model: Path, kit: SimpleNamespace) -> None:
    weights = kit.perturbed(tiny_model, seed=63)
    version = client.version() + 1
    manifest, buffers = kit.make_update(weights, version=version, bucket_bytes=300_000)
    client.ok("/weightsync/begin", {"manifest": manifest.without_digests().to_dict()})
    refused(client.post("/weightsync/begin", {"manifest": manifest.to_dict()}), 409, "is held by")
    good = kit.frame(manifest, 0, buffers[0])

    def post(frame: bytes) -> Any:
        return client.http.post("/weightsync/bucket", content=frame)

    refused(post(good[:-10]), 400, "truncated")
    corrupt = bytearray(good)
    corrupt[-1] ^= 0xFF
    refused(post(bytes(corrupt)), 400, "digest")
    refused(post(b"XXXX" + good[4:]), 400, "magic")
    other_version = kit.make_update(weights, version=version + 1, bucket_bytes=300_000)[0]
    refused(post(kit.frame(other_version, 0, buffers[0])), 409, f"v{version}")
    too_big = kit.frame(manifest, 0, buffers[0]) + b"\0" * (max(b.nbytes for b in manifest.buckets) + 70_000)
    refused(post(too_big), 413, "limit")
    # One good bucket is not an update: commit refuses, naming what never arrived.
    assert post(good).status_code == 200
    refused(client.post("/weightsync/commit", {"version": version}), 400, "never arrived")
    assert client.ok("/weightsync/abort", {"version": version})["aborted"] is True
    assert client.ok("/weightsync/abort", {"version": version})["aborted"] is False  # idempotent


def test_disk_paths_outside_the_root(client: Any, model_root: Path, tmp_path_factory: pytest.TempPathFactory,
                                     tiny_model: Path, kit: SimpleNamespace) -> None:
    outside = tmp_path_factory.mktemp("outside")
    weights = kit.perturbed(tiny_model, seed=64)
    manifest, buffers = kit.make_update(weights, version=client.version() + 1)
    escaped = kit.write_version_dir(outside, manifest, buffers)
    (model_root / "escape-link").symlink_to(escaped, target_is_directory=True)
    inner = model_root / "inner-link-dir"
    inner.mkdir()
    (inner / "manifest.json").write_text((escaped / "manifest.json").read_text())
    (inner / bucket_file_name(0)).symlink_to(escaped / bucket_file_name(0))
    for path in (str(escaped), f"{model_root}/../{outside.name}/{escaped.name}", str(model_root / "escape-link"),
                 str(inner), "/etc"):
        refused(client.post("/update_weights_from_disk", {"model_path": path}), 403, "outside the allowed root")
    refused(client.post("/update_weights_from_disk", {"model_path": str(model_root / "missing")}), 400, "missing")


def test_corrupt_disk_bucket_rolls_back(client: Any, model_root: Path, tiny_model: Path, kit: SimpleNamespace) -> None:
    weights = kit.perturbed(tiny_model, seed=65)
    manifest, buffers = kit.make_update(weights, version=client.version() + 1, bucket_bytes=300_000)
    (model_root / "corrupt").mkdir()
    directory = kit.write_version_dir(model_root / "corrupt", manifest, buffers)
    last = directory / bucket_file_name(len(buffers) - 1)
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF
    last.write_bytes(bytes(data))
    refused(client.post("/update_weights_from_disk", {"model_path": str(directory)}), 400, "digest")
    assert client.info()["session"] is None


def test_malicious_pickles_are_refused(client: Any, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class RunsShell:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    class Evaluates:
        def __reduce__(self) -> Any:
            return (eval, (f"open({str(marker)!r}, 'w')",))

    for payload, needle in ((RunsShell(), "system"), (Evaluates(), "builtins.eval")):
        body = {"serialized_named_tensors": [serialized([("model.norm.weight", payload)])]}
        refused(client.post("/update_weights_from_tensor", body), 400, "refused global", needle)
    refused(client.post("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]}), 400, "base64")
    refused(client.post("/update_weights_from_tensor",
                        {"serialized_named_tensors": [base64.b64encode(b"\x80\x04garbage").decode()]}), 400, "pickle")
    assert not marker.exists()


def test_misaligned_flattened_bucket(client: Any) -> None:
    flat = torch.zeros(6, dtype=torch.uint8)
    metadata = [{"name": "model.norm.weight", "shape": [1], "dtype": torch.float32, "start_idx": 2, "end_idx": 6}]
    body = {"serialized_named_tensors": [serialized({"flattened_tensor": flat, "metadata": metadata})],
            "load_format": "flattened_bucket"}
    refused(client.post("/update_weights_from_tensor", body), 400, "not a multiple of its itemsize")


def test_bad_generate_requests(client: Any) -> None:
    cases = [
        ({"input_ids": [1, 2, 100000]}, "vocabulary"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [1], "text": "a"}, "exactly one"),
        ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 5000}}, "positions"),
        ({"input_ids": [1], "lora_path": "some-adapter"}, "--enable-lora"),
    ]
    for body, needle in cases:
        refused(client.post("/generate", body), 400, needle)
    refused(client.http.post("/generate", content=b"{not json"), 400, "JSON")
    refused(client.http.post("/generate", content=b"[1, 2]"), 400, "JSON object")
    assert client.http.get("/health_generate").status_code == 200


LINKS = {
    "http": {"transport": "http"},
    "disk": {"transport": "disk", "root": "/nonexistent"},
    "broadcast": {"transport": "broadcast", "master_address": "127.0.0.1", "master_port": 1, "group_name": "g",
                  "world_size": 2, "rank_offset": 1, "backend": "gloo"},
}


@pytest.mark.parametrize("transport", list(LINKS))
def test_receive_refuses_a_transport_whose_bytes_come_another_way(client: Any, transport: str) -> None:
    body = {"version": 1, "index": 0, "link": LINKS[transport], "delivery": {"transport": transport}}
    refused(client.post("/weightsync/receive", body), 400, repr(transport), "does not deliver through")


def test_receive_refuses_a_link_without_its_transports_fields(client: Any) -> None:
    body = {"version": 1, "index": 0, "link": {"transport": "shm", "shm_name": "x"}, "delivery": {"transport": "shm"}}
    refused(client.post("/weightsync/receive", body), 400, "'shm' link needs ['num_slots', 'slot_bytes']")


def test_receive_names_the_valid_transports_and_needs_link_objects(client: Any) -> None:
    body = {"version": 1, "index": 0, "link": {"transport": "nccl"}, "delivery": {"transport": "nccl"}}
    refused(client.post("/weightsync/receive", body), 400, "'nccl'", "valid names: disk, http, broadcast, shm")
    refused(client.post("/weightsync/receive", {"version": 1, "index": 0, "link": ["shm"], "delivery": {}}),
            400, "'link' must be a JSON object")
