"""Every weight-update route of a real `weightsync serve`: after each, the served
weights equal the sent ones (digests computed here vs the server's) and the
weight version moves. SGLang's `weight_version` labels are free strings on every
route that takes one, reported back everywhere SGLang reports them."""

from __future__ import annotations

import base64
import pickle
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from weightsync.dtypes import dtype_name
from weightsync.formats.groups import UpdateGroup, finish_hosting, host_group
from weightsync.integrity import digest, names_digest
from weightsync.transports.shmem import SharedSlots

# fixtures server, client, tiny_model, model_root, kit: tests/support/server_fixtures.py

SOME = ["model.norm.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"]


def assert_served(client: Any, weights: dict[str, torch.Tensor], version: int) -> None:
    """The server serves `version` and every weight in `weights` bit for bit."""
    served = client.digests()
    assert client.version() == version
    assert {n: served[n] for n in weights} == {n: digest(t) for n, t in weights.items()}


def without_memory(ack: dict[str, Any]) -> dict[str, Any]:
    """A wire ack less the server's memory figures (`Ack.peak_extra_bytes`, `Ack.kept_bytes`),
    which this Linux server always measures: checked here, returned without them."""
    assert isinstance(ack.get("peak_extra_bytes"), int) and isinstance(ack.get("kept_bytes"), int), ack
    assert ack["peak_extra_bytes"] >= max(0, ack["kept_bytes"]), ack
    return {k: v for k, v in ack.items() if k not in ("peak_extra_bytes", "kept_bytes")}


def test_disk_manifest_dir_applies_and_generation_follows(client: Any, kit: SimpleNamespace, tiny_model: Path,
                                                          model_root: Path) -> None:
    version = client.version() + 1
    weights = kit.perturbed(tiny_model, seed=10)
    manifest, buffers = kit.make_update(weights, version=version, bucket_bytes=200_000)
    assert len(manifest.buckets) > 1
    directory = kit.write_version_dir(model_root, manifest, buffers)
    got = client.ok("/update_weights_from_disk", {"model_path": str(directory)})
    assert without_memory(got["ack"]) == {"version": version, "digests": list(manifest.digests),
                          "loaded_names": sorted(weights)}
    assert_served(client, weights, version)

    reference = kit.load_model(tiny_model, weights)
    want_tokens, want_logprobs = kit.reference_greedy(reference, [5, 17, 42], 8)
    answer = client.generate([5, 17, 42], sampling_params={"max_new_tokens": 8, "ignore_eos": True},
                             return_logprob=True)
    assert answer["output_ids"] == want_tokens
    assert answer["meta_info"]["weight_version"] == str(version)
    logprobs = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


def test_disk_plain_hf_checkpoint_is_a_full_update(client: Any, kit: SimpleNamespace, tiny_model: Path,
                                                   model_root: Path) -> None:
    version = client.version() + 1
    weights = kit.perturbed(tiny_model, seed=11)
    model = kit.load_model(tiny_model, weights)
    directory = model_root / f"hf-checkpoint-{version}"
    model.save_pretrained(directory)
    got = client.ok("/update_weights_from_disk", {"model_path": str(directory), "weight_version": str(version)})
    assert got["success"] is True and got["ack"]["version"] == version
    assert_served(client, weights, version)


def begin_and_send_frames(client: Any, kit: SimpleNamespace, weights: dict[str, Any], version: int) -> Any:
    """Begin `version` of `weights` over http and send every bucket as a frame (each acked with
    its digest); returns the manifest. Nothing is committed."""
    manifest, buffers = kit.make_update(weights, version=version, bucket_bytes=100_000)
    client.ok("/weightsync/begin", {"manifest": manifest.without_digests().to_dict()})
    for index, buffer in enumerate(buffers):
        got = client.http.post("/weightsync/bucket", content=kit.frame(manifest, index, buffer),
                               headers={"Content-Type": "application/octet-stream"})
        assert got.status_code == 200, got.text
        assert got.json()["digest"] == manifest.buckets[index].digest
    return manifest


def test_http_frames_begin_bucket_commit(client: Any, kit: SimpleNamespace, tiny_model: Path) -> None:
    version = client.version() + 1
    weights = kit.perturbed(tiny_model, seed=12)
    manifest = begin_and_send_frames(client, kit, weights, version)
    assert client.version() == version - 1  # nothing is served before commit
    ack = client.ok("/weightsync/commit", {"version": version})["ack"]
    assert without_memory(ack) == {"version": version, "digests": list(manifest.digests),
                                   "loaded_names": sorted(weights)}
    assert_served(client, weights, version)


def test_a_trainer_that_asks_gets_the_loaded_names_as_their_digest(client: Any, kit: SimpleNamespace,
                                                                   tiny_model: Path) -> None:
    """`"names_digest": true` in the commit: the ack's loaded names come as the digest of
    the names loaded (they are exactly the manifest's), not as the list."""
    version = client.version() + 1
    weights = kit.perturbed(tiny_model, seed=13)
    manifest = begin_and_send_frames(client, kit, weights, version)
    ack = client.ok("/weightsync/commit", {"version": version, "names_digest": True})["ack"]
    assert without_memory(ack) == {"version": version, "digests": list(manifest.digests),
                                   "names_digest": names_digest(weights)}
    assert_served(client, weights, version)


def test_delta_update_changes_only_the_sent_tensors(client: Any, kit: SimpleNamespace, tiny_model: Path) -> None:
    base = client.version()
    before = client.digests()
    delta = kit.perturbed(tiny_model, seed=13, names=SOME)
    manifest, buffers = kit.make_update(delta, version=base + 1, mode="delta", base_version=base)
    client.ok("/weightsync/begin", {"manifest": manifest.without_digests().to_dict()})
    for index, buffer in enumerate(buffers):
        client.ok("/weightsync/bucket", content=kit.frame(manifest, index, buffer))
    client.ok("/weightsync/commit", {"version": base + 1})
    after = client.digests()
    assert_served(client, delta, base + 1)
    assert {n for n in after if after[n] != before[n]} == set(SOME)


def test_shared_memory_slots(client: Any, kit: SimpleNamespace, tiny_model: Path) -> None:
    version = client.version() + 1
    weights = kit.perturbed(tiny_model, seed=14)
    manifest, buffers = kit.make_update(weights, version=version, bucket_bytes=150_000)
    slots = SharedSlots.create(slot_bytes=max(b.numel() for b in buffers), num_slots=2)
    try:
        client.ok("/weightsync/begin", {"manifest": manifest.without_digests().to_dict()})
        for index, buffer in enumerate(buffers):
            slot = index % 2
            slots.slot(slot, buffer.numel()).copy_(buffer)
            got = client.ok("/weightsync/shm_bucket", {
                "version": version, "index": index, "digest": manifest.buckets[index].digest,
                "shm_name": slots.name, "slot_bytes": slots.slot_bytes, "num_slots": slots.num_slots, "slot": slot,
            })
            assert got["digest"] == manifest.buckets[index].digest
        ack = client.ok("/weightsync/commit", {"version": version})["ack"]
    finally:
        slots.close()
    assert ack["digests"] == list(manifest.digests)
    assert_served(client, weights, version)


def serialized(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def test_update_weights_from_tensor_list(client: Any, kit: SimpleNamespace, tiny_model: Path) -> None:
    version = client.version() + 1
    weights = kit.perturbed(tiny_model, seed=15, names=SOME)
    # A non-contiguous tensor travels too.
    pairs = [(n, t.t().contiguous().t() if t.dim() == 2 else t) for n, t in weights.items()]
    got = client.ok("/update_weights_from_tensor", {"serialized_named_tensors": [serialized(pairs)],
                                                    "weight_version": str(version), "flush_cache": False})
    assert got["ack"]["version"] == version
    assert_served(client, weights, version)


@dataclass
class _Meta:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


# Pickled under SGLang's own name (the server maps it to a plain stand-in).
SGLANG_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
_Meta.__module__ = SGLANG_BUCKET_MODULE
_Meta.__qualname__ = "FlattenedTensorMetadata"


def test_update_weights_from_tensor_flattened_bucket_in_sglang_format(client: Any, kit: SimpleNamespace,
                                                                      tiny_model: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Pickle metadata exactly as SGLang's FlattenedTensorBucket does: instances of
    # sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata and a uint8 buffer.
    module = types.ModuleType(SGLANG_BUCKET_MODULE)
    module.FlattenedTensorMetadata = _Meta  # type: ignore[attr-defined]
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, module.__name__, module)

    version = client.version() + 1
    weights = kit.perturbed(tiny_model, seed=16, names=SOME)
    flat, metadata, offset = [], [], 0
    for name, tensor in weights.items():
        raw = tensor.flatten().view(torch.uint8)
        metadata.append(_Meta(name, tensor.shape, tensor.dtype, offset, offset + raw.numel(), raw.numel()))
        flat.append(raw)
        offset += raw.numel()
    bucket = {"flattened_tensor": torch.cat(flat), "metadata": metadata}
    client.ok("/update_weights_from_tensor", {"serialized_named_tensors": [serialized(bucket)],
                                              "load_format": "flattened_bucket", "weight_version": str(version)})
    assert_served(client, weights, version)


def test_sglang_session_applies_at_end(client: Any, kit: SimpleNamespace, tiny_model: Path) -> None:
    version = client.version() + 1
    weights = kit.perturbed(tiny_model, seed=17, names=SOME)
    before = client.digests()
    client.ok("/begin_weight_update", {"selector": "all"})
    for name, tensor in weights.items():
        client.ok("/update_weights_from_tensor", {"serialized_named_tensors": [serialized([(name, tensor)])],
                                                  "weight_version": str(version)})
    assert client.digests() == before and client.version() == version - 1
    got = client.ok("/end_weight_update", {})
    assert got["ack"]["version"] == version
    assert_served(client, weights, version)


def test_update_weight_version(client: Any) -> None:
    version = client.version()
    before = client.digests()
    got = client.ok("/update_weight_version", {"new_version": "step_10", "abort_all_requests": False})
    assert got["new_version"] == "step_10"  # SGLang's answer, read by its own test
    assert client.version() == version and client.digests() == before  # a label, not an update
    assert_labelled(client, "step_10", version)
    client.ok("/update_weight_version", {"new_version": "step_10"})  # the same label again: accepted
    assert_labelled(client, "step_10", version)


def assert_labelled(client: Any, label: str, version: int) -> None:
    """SGLang's label is reported wherever SGLang reports it; weightsync's integer
    version stays in /weightsync/info beside it."""
    info = client.info()
    assert (info["weight_version"], info["label"]) == (version, label)
    for route in ("/model_info", "/get_model_info", "/get_weight_version"):
        assert client.http.get(route).json()["weight_version"] == label, route
    meta = client.generate([5, 17, 42], sampling_params={"max_new_tokens": 2, "ignore_eos": True})["meta_info"]
    assert meta["weight_version"] == label
    assert meta["weight_versions"] == [{"version": label, "start": 0, "end": 2, "weightsync_version": version}]


def test_sglang_labels_are_free_strings_on_tensor_and_disk_updates(client: Any, kit: SimpleNamespace,
                                                                   tiny_model: Path, model_root: Path) -> None:
    # Each SGLang-shaped update is applied on arrival as weightsync's next version, under its label.
    version = client.version()
    weights = kit.perturbed(tiny_model, seed=21, names=SOME)
    got = client.ok("/update_weights_from_tensor", {"serialized_named_tensors": [serialized(list(weights.items()))],
                                                    "weight_version": "v1", "flush_cache": False})
    assert got["ack"]["version"] == version + 1
    assert_served(client, weights, version + 1)
    assert_labelled(client, "v1", version + 1)

    # No label: SGLang keeps the current one (the weights still move on).
    weights = kit.perturbed(tiny_model, seed=22, names=SOME)
    client.ok("/update_weights_from_tensor", {"serialized_named_tensors": [serialized(list(weights.items()))]})
    assert_served(client, weights, version + 2)
    assert_labelled(client, "v1", version + 2)

    # A plain Hugging Face checkpoint from disk, labelled.
    weights = kit.perturbed(tiny_model, seed=23)
    directory = model_root / "hf-checkpoint-step_10"
    kit.load_model(tiny_model, weights).save_pretrained(directory)
    client.ok("/update_weights_from_disk", {"model_path": str(directory), "weight_version": "step_10"})
    assert_served(client, weights, version + 3)
    assert_labelled(client, "step_10", version + 3)

    # A weightsync version directory keeps its own integer version; the label is the request's.
    weights = kit.perturbed(tiny_model, seed=24)
    manifest, buffers = kit.make_update(weights, version=version + 10, bucket_bytes=200_000)
    directory = kit.write_version_dir(model_root, manifest, buffers)
    got = client.ok("/update_weights_from_disk", {"model_path": str(directory), "weight_version": "ckpt-a"})
    assert got["ack"]["version"] == version + 10
    assert_served(client, weights, version + 10)
    assert_labelled(client, "ckpt-a", version + 10)

    # weightsync's own order is untouched by labels: an older push is refused, a newer one
    # is labelled with its version.
    stale, _ = kit.make_update(weights, version=version + 9)
    refused = client.post("/weightsync/begin", {"manifest": stale.to_dict()})
    assert refused.status_code == 409 and "not newer" in refused.json()["message"]
    weights = kit.perturbed(tiny_model, seed=25)
    manifest, buffers = kit.make_update(weights, version=version + 11, bucket_bytes=200_000)
    client.ok("/weightsync/begin", {"manifest": manifest.without_digests().to_dict()})
    for index, buffer in enumerate(buffers):
        client.ok("/weightsync/bucket", content=kit.frame(manifest, index, buffer))
    client.ok("/weightsync/commit", {"version": version + 11})
    assert_labelled(client, str(version + 11), version + 11)


def test_a_server_started_with_a_label(tiny_model: Path, kit: SimpleNamespace) -> None:
    for server in kit.start_server(tiny_model, "--weight-version", "step_0"):  # SGLang's --weight-version
        client = kit.Client(server.url)
        try:
            assert_labelled(client, "step_0", 0)
        finally:
            client.close()


def test_model_info_names_the_last_disk_update(client: Any, kit: SimpleNamespace, tiny_model: Path,
                                               model_root: Path) -> None:
    # SGLang's test: model_path follows a successful load and stays put after a failed one.
    weights = kit.perturbed(tiny_model, seed=26)
    directory = model_root / "hf-checkpoint-model-path"
    kit.load_model(tiny_model, weights).save_pretrained(directory)
    client.ok("/update_weights_from_disk", {"model_path": str(directory)})
    version = client.version()
    broken = model_root / "hf-checkpoint-broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    assert client.post("/update_weights_from_disk", {"model_path": str(broken)}).status_code == 400
    for route in ("/model_info", "/get_model_info"):
        assert client.http.get(route).json()["model_path"] == str(directory)
        assert client.http.get(route).json()["tokenizer_path"] == str(tiny_model)
    assert_served(client, weights, version)


def _join(client: Any, group_name: str) -> UpdateGroup:
    holder, port = host_group(master_address="127.0.0.1", world_size=2, group_name=group_name, backend="gloo",
                              timeout_s=60)
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(client.post, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": "gloo",
        })
        group = finish_hosting(holder, timeout_s=60)
        response = joining.result()
    assert response.status_code == 200, response.text
    return group


def _broadcast(client: Any, group: UpdateGroup, body: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    with ThreadPoolExecutor(1) as pool:
        receiving = pool.submit(client.post, "/update_weights_from_distributed", body)
        for tensor in tensors:
            group.broadcast(tensor, src=0, timeout_s=60)
        response = receiving.result()
    assert response.status_code == 200, response.text
    return response.json()


def test_broadcast_from_a_gloo_group(client: Any, kit: SimpleNamespace, tiny_model: Path) -> None:
    group_name = "test-broadcast"
    group = _join(client, group_name)
    try:
        # 1. SGLang's default: one broadcast per tensor, applied by the call itself.
        version = client.version() + 1
        weights = kit.perturbed(tiny_model, seed=18, names=SOME)
        names = list(weights)
        spec = {"names": names, "dtypes": [dtype_name(weights[n].dtype) for n in names],
                "shapes": [list(weights[n].shape) for n in names], "group_name": group_name}
        _broadcast(client, group, {**spec, "weight_version": str(version)}, [weights[n] for n in names])
        assert_served(client, weights, version)

        # 2. flattened_bucket: one uint8 buffer, tensors back to back in listed order.
        version += 1
        weights = kit.perturbed(tiny_model, seed=19, names=SOME)
        flat = torch.cat([weights[n].flatten().view(torch.uint8) for n in names])
        _broadcast(client, group, {**spec, "weight_version": str(version), "load_format": "flattened_bucket"}, [flat])
        assert_served(client, weights, version)

        # 3. Inside a weightsync session: buckets checked against the manifest and its digests.
        version += 1
        weights = kit.perturbed(tiny_model, seed=20)
        manifest, buffers = kit.make_update(weights, version=version, bucket_bytes=120_000)
        client.ok("/weightsync/begin", {"manifest": manifest.without_digests().to_dict()})
        for bucket, buffer in zip(manifest.buckets, buffers, strict=True):
            entries = bucket.entries
            _broadcast(client, group, {
                "names": [e.hf_name for e in entries], "dtypes": [dtype_name(e.dtype) for e in entries],
                "shapes": [list(e.shape) for e in entries], "group_name": group_name,
                "load_format": "flattened_bucket", "weightsync_version": version,
                "weightsync_bucket": bucket.index, "weightsync_digest": bucket.digest,
            }, [buffer])
        ack = client.ok("/weightsync/commit", {"version": version})["ack"]
        assert ack["digests"] == list(manifest.digests)
        assert_served(client, weights, version)

        # 4. slime: every bucket of one update carries the same label; each is applied on
        # arrival (as SGLang does), so between the two the engine serves bucket 1 only.
        weights = kit.perturbed(tiny_model, seed=27, names=SOME)
        before = client.digests()
        sent: set[str] = set()
        for count, bucket in enumerate((names[:1], names[1:]), start=1):
            spec = {"names": bucket, "dtypes": [dtype_name(weights[n].dtype) for n in bucket],
                    "shapes": [list(weights[n].shape) for n in bucket], "group_name": group_name,
                    "load_format": "flattened_bucket", "weight_version": "1", "flush_cache": False}
            flat = torch.cat([weights[n].flatten().view(torch.uint8) for n in bucket])
            _broadcast(client, group, spec, [flat])
            sent |= set(bucket)
            assert_labelled(client, "1", version + count)
            served = client.digests()
            assert {n for n in SOME if served[n] != before[n]} == sent
        assert_served(client, weights, version + 2)
    finally:
        client.ok("/destroy_weights_update_group", {"group_name": group_name})
        group.destroy()


def test_a_push_reports_the_servers_memory(client: Any, kit: SimpleNamespace, tiny_model: Path) -> None:
    """A push's `SyncReport` carries the server's memory figures in its ack, as measured at the
    commit (`process_memory.MemoryMark`: /proc's peak and current resident set against those at
    begin), and its JSON form keeps them. Their size is the allocator's business here (a 1.7 MB
    update may reuse freed heap): tests/unit/test_process_memory.py checks the measurement
    itself against known allocations."""
    import weightsync

    weights = kit.perturbed(tiny_model, seed=91)
    trainer = kit.load_model(tiny_model, weights)
    with weightsync.WeightSync([weightsync.SGLangEngine(client.url)], transport="http") as sync:
        report = sync.push(trainer, version=client.version() + 1)
    (ack,) = report.acks
    assert report.verified and isinstance(ack.peak_extra_bytes, int) and isinstance(ack.kept_bytes, int)
    assert ack.peak_extra_bytes >= max(0, ack.kept_bytes), (ack.peak_extra_bytes, ack.kept_bytes)
    assert report.to_dict()["acks"][0]["peak_extra_bytes"] == ack.peak_extra_bytes
    assert_served(client, weights, report.version)
