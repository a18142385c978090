"""Peer clients' request sequences replayed verbatim against `weightsync serve`
(issue 19): bodies, field names, value types and call order as the peers' code
writes them. Each sequence names the file (and commit) it was read from.

Payloads that peers build with SGLang's own classes are built here by hand in
SGLang's pickled layout (the sglang wheel is not installed by scripts/test.sh yet).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from test_server_torn_updates import PROMPT, flattened_bucket, halves

pytest_plugins = ["test_server_support"]  # fixtures: server, client, tiny_model, model_root, ws


def test_slime_external_engine_training_step(client: Any, ws: SimpleNamespace, tiny_model: Path) -> None:
    # THUDM/slime @ 624b824a: slime/backends/sglang_utils/external.py get_server_info (tries /server_info,
    # then /get_server_info) and discover_external_engines (tp/pp sizes, num_gpus).
    info = client.http.get("/server_info").json()
    assert int(info.get("tp_size") or 1) * int(info.get("pp_size") or 1) == 1
    assert info.get("disaggregation_mode") not in ("prefill", "decode") and not info.get("encoder_only")

    # slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py update_weights:
    # pause -> flush -> buckets (same weight_version on each) -> continue; bodies from
    # slime/backends/sglang_utils/sglang_engine.py (SGLangEngine.pause_generation, flush_cache,
    # update_weights_from_tensor, continue_generation).
    weights = ws.perturbed(tiny_model, seed=60)
    assert client.http.post("/pause_generation", json={}).status_code == 200
    assert client.http.get("/flush_cache").status_code == 200
    for names in halves(client):
        response = client.http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [flattened_bucket(weights, names)], "load_format": "flattened_bucket",
            "flush_cache": False, "weight_version": "1"})
        assert response.status_code == 200, response.text
    assert client.http.post("/continue_generation", json={}).status_code == 200

    # slime's CI mode: SGLangEngine.get_weight_version (GET, reads "weight_version").
    assert client.http.get("/get_weight_version").json()["weight_version"] == "1"
    want, _ = ws.reference_greedy(ws.load_model(tiny_model, weights), PROMPT, 8)
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
    for names in halves(client):
        response = client.http.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [flattened_bucket(weights, names)], "load_format": "flattened_bucket",
            "flush_cache": False, "weight_version": "2"})
        assert response.status_code == 200, response.text
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
