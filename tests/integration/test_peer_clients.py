"""Peer clients' request sequences replayed verbatim against `weightsync serve`
(issue 19): bodies, field names, value types and call order as the peers' code
writes them. Each sequence names the file (and commit) it was read from, and
ends by checking that the engine serves what was sent (served digests equal the
sent tensors', greedy tokens equal transformers' for the same tensors).

Payloads that peers build with SGLang's own classes (FlattenedTensorBucket,
LocalSerializedTensor, MultiprocessingSerializer) are built with those classes,
loaded from the sglang wheel's files (`sglang_wheel`; the tests that need them
skip, naming the fix, when scripts/test.sh has not installed them).

MultiprocessingSerializer writes a shared-memory handle for a CPU tensor (a CUDA
IPC handle on a GPU): the colocated path of verl, slime and XTuner. This server
refuses those payloads (400 naming why, nothing served changes); the same
structures serialized with pickle.dumps, which a client on another host would
send, are accepted.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import sglang_wheel
from server_fixtures import PROMPT, halves, make_adapter
from sglang_wheel import b64
from weightsync.dtypes import dtype_name
from weightsync.integrity import digest

# fixtures server, client, tiny_model, model_root, kit: tests/support/server_fixtures.py

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model: Path, kit: SimpleNamespace, one_torch_thread: None) -> Iterator[Any]:
    # AReaL's LoRA flow needs --enable-lora (its launcher passes it with use_lora).
    yield from kit.start_server(tiny_model, "--enable-lora")


@pytest.fixture(scope="module")
def sglang() -> Iterator[SimpleNamespace]:
    with sglang_wheel.loaded() as classes:
        yield classes


def flattened_bucket(sglang: SimpleNamespace, weights: dict[str, torch.Tensor], names: list[str]) -> dict[str, Any]:
    """slime/XTuner's flattened_tensor_data, built with SGLang's FlattenedTensorBucket."""
    bucket = sglang.FlattenedTensorBucket(named_tensors=[(n, weights[n]) for n in names])
    return {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}


def plain(obj: Any) -> str:
    """A payload serialized with pickle.dumps (bytes, not a shared-memory handle), base64."""
    return b64(pickle.dumps(obj))


def assert_serves(client: Any, kit: SimpleNamespace, tiny_model: Path, weights: dict[str, torch.Tensor],
                  label: str | None = None) -> None:
    """The engine serves exactly `weights`: digests and transformers' greedy tokens."""
    served = client.digests()
    assert {n: served[n] for n in weights} == {n: digest(t) for n, t in weights.items()}
    want, _ = kit.reference_greedy(kit.load_model(tiny_model, weights), PROMPT, 8)
    got = client.http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}).json()
    assert got["output_ids"] == want
    if label is not None:
        assert got["meta_info"]["weight_version"] == label


def assert_shared_memory_refused(response: Any, client: Any, before: dict[str, str]) -> None:
    assert response.status_code == 400, response.text
    assert "MultiprocessingSerializer" in response.json()["message"]
    assert "pickle.dumps" in response.json()["message"]
    assert client.digests() == before


def test_slime_external_engine_training_step(client: Any, kit: SimpleNamespace, tiny_model: Path,
                                             sglang: SimpleNamespace) -> None:
    # THUDM/slime @ 624b824a: slime/backends/sglang_utils/external.py get_server_info (tries /server_info,
    # then /get_server_info) and discover_external_engines (tp/pp sizes, num_gpus).
    info = client.http.get("/server_info").json()
    assert int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1) == 1
    assert info.get("disaggregation_mode") not in ("prefill", "decode") and not info.get("encoder_only")

    # slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py update_weights:
    # pause -> flush -> buckets (same weight_version on each) -> continue; bodies from
    # slime/backends/sglang_utils/sglang_engine.py (SGLangEngine.pause_generation, flush_cache,
    # update_weights_from_tensor, continue_generation).
    weights = kit.perturbed(tiny_model, seed=60)

    def send_buckets(label: str) -> None:
        for names in halves(client):
            response = client.http.post("/update_weights_from_tensor", json={
                "serialized_named_tensors": [plain(flattened_bucket(sglang, weights, names))],
                "load_format": "flattened_bucket",
                "flush_cache": False, "weight_version": label})
            assert response.status_code == 200, response.text

    assert client.http.post("/pause_generation", json={}).status_code == 200
    assert client.http.get("/flush_cache").status_code == 200
    send_buckets("1")
    assert client.http.post("/continue_generation", json={}).status_code == 200

    # slime's CI mode: SGLangEngine.get_weight_version (GET, reads "weight_version").
    assert client.http.get("/get_weight_version").json()["weight_version"] == "1"
    want, _ = kit.reference_greedy(kit.load_model(tiny_model, weights), PROMPT, 8)
    got = client.http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}).json()
    assert got["output_ids"] == want and got["meta_info"]["weight_version"] == "1"

    # slime/rollout/sglang_rollout.py: end of every rollout aborts what is left.
    assert client.http.post("/abort_request", json={"abort_all": True}).status_code == 200

    # slime/backends/sglang_utils/sglang_engine.py release_memory_occupation ({} after flush_cache)
    # and resume_memory_occupation({"tags": tags}); then the next update restores the weights.
    assert client.http.get("/flush_cache").status_code == 200
    assert client.http.post("/release_memory_occupation", json={}).status_code == 200
    assert client.http.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    send_buckets("2")
    assert client.http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert client.http.post("/resume_memory_occupation", json={"tags": None}).status_code == 200
    got = client.http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}).json()
    assert got["output_ids"] == want and got["meta_info"]["weight_version"] == "2"


def test_sglang_weight_version_test_reads_new_version(client: Any) -> None:
    # sgl-project/sglang test/srt/test_weight_version.py and http_server.py update_weight_version:
    # the answer carries "new_version"; /model_info and /get_model_info report it.
    got = client.http.post("/update_weight_version", json={"new_version": "v2.0", "abort_all_requests": True}).json()
    assert got["success"] is True and got["new_version"] == "v2.0"
    for route in ("/model_info", "/get_model_info"):
        assert client.http.get(route).json()["weight_version"] == "v2.0"


def test_verl_rollout_weight_sync(client: Any, kit: SimpleNamespace, tiny_model: Path, sglang: SimpleNamespace) -> None:
    # volcengine/verl @ b178a3cd: verl/workers/fsdp_workers.py rollout_mode (resume(["weights"]) ->
    # update_weights -> resume(["kv_cache"])); verl/workers/rollout/sglang_rollout/sglang_rollout.py
    # (release: tags ["kv_cache", "weights"]; update_weights: buckets through SGLang's
    # weight_sync/utils.py update_weights, then flush_cache); http_server_engine.py
    # AsyncHttpServerAdapter (bodies; base64 of each serialized entry; GET /flush_cache).
    weights = kit.perturbed(tiny_model, seed=61)
    before = client.digests()

    def update_request(serialize_tensor: Any) -> dict[str, Any]:
        # sglang/srt/weight_sync/utils.py update_weights (sglang 0.5.23), TP size 1: each tensor
        # serialized for its rank, wrapped in LocalSerializedTensor, the list serialized again.
        named_tensors = [(name, sglang.LocalSerializedTensor(values=[serialize_tensor(tensor)]))
                         for name, tensor in weights.items()]
        serialized = [sglang.MultiprocessingSerializer.serialize(named_tensors)]
        return {"serialized_named_tensors": [b64(s) for s in serialized], "load_format": None, "flush_cache": True}

    assert client.http.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]}).status_code == 200
    assert client.http.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    # Verbatim (colocated): each tensor by MultiprocessingSerializer, a shared-memory handle on CPU.
    refused = client.http.post("/update_weights_from_tensor",
                               json=update_request(sglang.MultiprocessingSerializer.serialize))
    assert refused.status_code == 400 and "MultiprocessingSerializer" in refused.json()["message"]
    # The same structure with each tensor's bytes (pickle.dumps) is accepted.
    response = client.http.post("/update_weights_from_tensor", json=update_request(pickle.dumps))
    assert response.status_code == 200, response.text
    assert client.http.get("/flush_cache").status_code == 200
    assert client.http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert client.digests() != before
    assert_serves(client, kit, tiny_model, weights)
    # AsyncHttpServerAdapter.abort_request defaults.
    assert client.http.post("/abort_request", json={"rid": "", "abort_all": True}).status_code == 200


def test_verl_colocated_payload_changes_nothing(client: Any, sglang: SimpleNamespace, kit: SimpleNamespace,
                                                tiny_model: Path) -> None:
    # The verbatim verl payload alone (see above): refused with the reason, served weights unchanged.
    before = client.digests()
    named_tensors = [(name, sglang.LocalSerializedTensor(values=[sglang.MultiprocessingSerializer.serialize(t)]))
                     for name, t in kit.perturbed(tiny_model, seed=62).items()]
    response = client.http.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [b64(sglang.MultiprocessingSerializer.serialize(named_tensors))],
        "load_format": None, "flush_cache": True})
    assert_shared_memory_refused(response, client, before)


def test_xtuner_offload_pause_and_flattened_update(client: Any, kit: SimpleNamespace, tiny_model: Path,
                                                   sglang: SimpleNamespace) -> None:
    # InternLM/xtuner @ b934f462: xtuner/v1/rl/rollout/sglang.py (offload: GET /flush_cache then
    # release_memory_occupation with json={}; onload_weights / onload_kvcache; pause_generation
    # {"mode": "abort"}; continue_generation {}), xtuner/v1/rl/weight_update/transport.py
    # (serialize: FlattenedTensorBucket -> MultiprocessingSerializer.serialize(..., output_str=True);
    # build_request: serialized_named_tensors, flush_cache False, load_format "flattened_bucket").
    weights = kit.perturbed(tiny_model, seed=63)
    assert client.http.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    assert client.http.get("/flush_cache").status_code == 200
    assert client.http.post("/release_memory_occupation", json={}).status_code == 200
    assert client.http.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    before = client.digests()
    first, second = halves(client)
    verbatim = client.http.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [sglang.MultiprocessingSerializer.serialize(
            flattened_bucket(sglang, weights, first), output_str=True)],
        "flush_cache": False, "load_format": "flattened_bucket"})
    assert_shared_memory_refused(verbatim, client, before)
    for names in (first, second):
        response = client.http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [plain(flattened_bucket(sglang, weights, names))],
            "flush_cache": False, "load_format": "flattened_bucket"})
        assert response.status_code == 200, response.text
    assert client.http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert client.http.post("/continue_generation", json={}).status_code == 200
    assert_serves(client, kit, tiny_model, weights)


def areal_generate(client: Any, lora_name: str | None = None) -> dict[str, Any]:
    # inclusionAI/AReaL @ 4aef98d8: areal/engine/sglang_remote.py SGLangBackend.build_generation_request
    # (GenerationHyperparameters defaults, greedy) and parse_generation_response.
    payload: dict[str, Any] = {"input_ids": list(PROMPT), "image_data": None, "sampling_params": {
        "top_p": 1.0, "top_k": 100000000, "max_new_tokens": 8, "temperature": 0.0, "stop_token_ids": [],
        "ignore_eos": True, "skip_special_tokens": True, "frequency_penalty": 0.0},
        "return_logprob": True, "stream": False}
    if lora_name is not None:
        payload["lora_path"] = lora_name
    response = client.http.post("/generate", json=payload)
    assert response.status_code == 200, response.text
    meta_info = response.json()["meta_info"]
    assert meta_info["finish_reason"]["type"] == "length"
    return {"tokens": [x[1] for x in meta_info["output_token_logprobs"]],
            "logprobs": [x[0] for x in meta_info["output_token_logprobs"]], "meta_info": meta_info}


def test_areal_disk_update(client: Any, kit: SimpleNamespace, tiny_model: Path, model_root: Path) -> None:
    # inclusionAI/AReaL @ 4aef98d8: areal/engine/sglang_remote.py get_pause_request,
    # build_disk_weight_update_requests (full model), get_resume_request.
    weights = kit.perturbed(tiny_model, seed=64)
    saved = model_root / "areal-step-1"
    kit.load_model(tiny_model, weights).save_pretrained(saved)
    assert client.http.post("/pause_generation", json={}).status_code == 200
    response = client.http.post("/update_weights_from_disk", json={"model_path": str(saved),
                                                                   "abort_all_requests": True})
    assert response.status_code == 200, response.text
    assert client.http.post("/continue_generation", json={}).status_code == 200
    want, _ = kit.reference_greedy(kit.load_model(tiny_model, weights), PROMPT, 8)
    assert areal_generate(client)["tokens"] == want
    assert_serves(client, kit, tiny_model, weights)


def test_areal_distributed_update(client: Any, kit: SimpleNamespace, tiny_model: Path) -> None:
    # inclusionAI/AReaL @ 4aef98d8: areal/engine/sglang_remote.py build_init_weights_group_request
    # (pp_size 1: master_port as a string, rank_offset 1, world_size 1 + engine ranks) and
    # build_distributed_weight_update_requests (dtypes as strings, no load_format: one broadcast
    # per tensor, in the listed order), between pause and continue.
    group_name = "update_weight_group"
    group = kit.joined_group(lambda body: client.http.post("/init_weights_update_group", json=body), group_name,
                            lambda port: {"master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1,
                                          "world_size": 2, "backend": "gloo", "group_name": group_name})
    try:
        weights = kit.perturbed(tiny_model, seed=65)
        assert client.http.post("/pause_generation", json={}).status_code == 200
        for names in halves(client):
            with ThreadPoolExecutor(1) as pool:
                receiving = pool.submit(client.http.post, "/update_weights_from_distributed", json={
                    "names": names, "dtypes": [dtype_name(weights[n].dtype) for n in names],
                    "shapes": [list(weights[n].shape) for n in names], "group_name": group_name,
                    "abort_all_requests": True})
                for name in names:
                    group.broadcast(weights[name], src=0, timeout_s=60)
                assert receiving.result().status_code == 200, receiving.result().text
        assert client.http.post("/continue_generation", json={}).status_code == 200
        assert_serves(client, kit, tiny_model, weights)
    finally:
        assert client.http.post("/destroy_weights_update_group", json={"group_name": group_name}).status_code == 200
        group.destroy()


def test_areal_versioned_lora_from_disk(client: Any, kit: SimpleNamespace, tiny_model: Path,
                                        model_root: Path) -> None:
    # inclusionAI/AReaL @ 4aef98d8: build_disk_weight_update_requests with use_lora loads
    # get_versioned_lora_name(name, version) = f"{name}-v{version}" (areal/api/io_struct.py) and never
    # unloads; generation names the current version in lora_path.
    from peft import PeftModel

    adapters = [make_adapter(tiny_model, model_root / "areal-lora" / f"v{v}", seed=70 + v) for v in (1, 2)]
    # Back to the launch weights first (an AReaL disk update), so PEFT's reference has the same base.
    assert client.http.post("/update_weights_from_disk", json={"model_path": str(tiny_model),
                                                               "abort_all_requests": True}).status_code == 200
    base = areal_generate(client)["tokens"]
    for version, adapter_dir in enumerate(adapters, start=1):
        response = client.http.post("/load_lora_adapter", json={"lora_name": f"policy-v{version}",
                                                               "lora_path": str(adapter_dir)})
        assert response.status_code == 200, response.text
        peft_model = PeftModel.from_pretrained(kit.load_model(tiny_model), adapter_dir).eval()
        tokens, logprobs = kit.reference_greedy(peft_model, PROMPT, 8)
        got = areal_generate(client, f"policy-v{version}")
        assert got["tokens"] == tokens and tokens != base
        assert max(abs(a - b) for a, b in zip(got["logprobs"], logprobs, strict=True)) < 1e-4
    assert areal_generate(client, "policy-v1")["tokens"] != areal_generate(client, "policy-v2")["tokens"]
    for version in (1, 2):
        assert client.http.post("/unload_lora_adapter", json={"lora_name": f"policy-v{version}"}).status_code == 200


def launch_weights(kit: SimpleNamespace, tiny_model: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's own weights, by served (HF) name: what a trainer resumed from it holds."""
    from weightsync.naming import map_names

    return {p.hf_name: p.param.detach().contiguous() for p in map_names(kit.load_model(tiny_model)).params}


def miles_weights_checker(client: Any, action: str) -> Any:
    # radixark/miles @ 05265438: miles/backends/sglang_utils/sglang_api_client.py check_weights
    # (POST /weights_checker {"action", "allow_quant_error", "selector"}).
    return client.http.post("/weights_checker", json={"action": action, "allow_quant_error": False,
                                                      "selector": "all"})


def miles_distributed_update(client: Any, group: Any, group_name: str, weights: dict[str, torch.Tensor],
                             buckets: list[list[str]], version: int) -> None:
    # radixark/miles @ 0015b711: update_weight_from_distributed/mixin.py update_weights:
    # pause_generation(mode) -> flush_cache (mode is not in_place) -> begin_weight_update -> buckets ->
    # end_weight_update -> continue_generation; broadcast.py update_weights_from_distributed sends each
    # bucket's names/dtypes/shapes with weight_version=str(version); sglang_engine.py adds flush_cache
    # False and selector "all". Bodies as miles' SGLangEngine writes them.
    assert client.http.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    assert client.http.get("/flush_cache").status_code == 200
    assert client.http.post("/begin_weight_update", json={"selector": "all"}).status_code == 200
    for names in buckets:
        with ThreadPoolExecutor(1) as pool:
            receiving = pool.submit(client.http.post, "/update_weights_from_distributed", json={
                "names": names, "dtypes": [str(weights[n].dtype).replace("torch.", "") for n in names],
                "shapes": [list(weights[n].shape) for n in names], "group_name": group_name,
                "flush_cache": False, "selector": "all", "weight_version": str(version)})
            for name in names:
                group.broadcast(weights[name], src=0, timeout_s=60)
            assert receiving.result().status_code == 200, receiving.result().text
    assert client.http.post("/end_weight_update", json={}).status_code == 200
    assert client.http.post("/continue_generation", json={}).status_code == 200


def test_miles_check_weight_update_equal(client: Any, kit: SimpleNamespace, tiny_model: Path,
                                        sglang: SimpleNamespace) -> None:
    # radixark/miles: train.py with --check-weight-update-equal: the rollout manager's engines
    # snapshot the weights they loaded, reset them, the actor pushes its weights, and
    # check_weights(action="compare") must find every tensor restored.
    # sglang_engine.py _init_external: GET /get_server_info, its parallel sizes checked.
    info = client.http.get("/get_server_info").json()
    assert (info["tp_size"], info["dp_size"], info["pp_size"]) == (1, 1, 1)
    assert client.http.post("/update_weights_from_disk", json={"model_path": str(tiny_model)}).status_code == 200
    weights = launch_weights(kit, tiny_model)

    # broadcast.py connect_rollout_engines_from_distributed: destroy the group first (an engine
    # without it answers an error, which miles ignores), then init it. miles asks for "nccl"; this
    # CPU engine refuses it naming 'gloo', which is what a CPU run sends.
    group_name = "miles-pp_0"
    assert client.http.post("/destroy_weights_update_group", json={"group_name": group_name}).status_code == 400
    refused = client.http.post("/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
        "group_name": group_name, "backend": "nccl"})
    assert refused.status_code == 400 and "'gloo'" in refused.json()["message"]
    group = kit.joined_group(lambda body: client.http.post("/init_weights_update_group", json=body), group_name,
                            lambda port: {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                                          "world_size": 2, "group_name": group_name, "backend": "gloo"})
    try:
        names = sorted(weights)
        for action in ("snapshot", "reset_tensors"):
            assert miles_weights_checker(client, action).status_code == 200
        # Reset weights are no update's: nothing is served from them.
        assert client.http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}).status_code == 503
        miles_distributed_update(client, group, group_name, weights, [names[: len(names) // 2],
                                                                      names[len(names) // 2 :]], version=1)
        compared = miles_weights_checker(client, "compare")
        assert compared.status_code == 200, compared.text
        # sglang_api_client.py get_weight_version: /model_info first.
        assert client.http.get("/model_info").json()["weight_version"] == "1"
        assert_serves(client, kit, tiny_model, weights, label="1")
        # The checksum action (sglang weight_checker.py), computed by SGLang's own functions here.
        checksum = miles_weights_checker(client, "checksum").json()
        sums = {n: sglang.hash_tensor(t) for n, t in weights.items()}
        assert checksum["ranks"][0]["checksums"] == sums
        assert checksum["ranks"][0]["per_gpu_checksum"] == sglang.overall_checksum(sums)

        # A push that leaves one tensor out does not pass the compare, which names it.
        for action in ("snapshot", "reset_tensors"):
            assert miles_weights_checker(client, action).status_code == 200
        miles_distributed_update(client, group, group_name, weights, [names[:-1]], version=2)
        failed = miles_weights_checker(client, "compare")
        assert failed.status_code == 400 and repr(names[-1]) in failed.json()["message"], failed.text
        assert client.http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}).status_code == 503
        # A revert from disk serves the checkpoint again.
        assert client.http.post("/update_weights_from_disk", json={"model_path": str(tiny_model)}).status_code == 200
        assert_serves(client, kit, tiny_model, weights)
    finally:
        assert client.http.post("/destroy_weights_update_group", json={"group_name": group_name}).status_code == 200
        group.destroy()
