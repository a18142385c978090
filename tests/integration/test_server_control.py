"""SGLang's engine-control routes on a real `weightsync serve` (issue 19 item 2):
`/server_info`, `/abort_request`, `/release_memory_occupation` and
`/resume_memory_occupation`, with SGLang's request shapes (io_struct.py: AbortReq,
Release/ResumeMemoryOccupationReqInput)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from weightsync.integrity import digest

# fixtures server, client, tiny_model, model_root, kit: tests/support/server_fixtures.py

PROMPT = [5, 17, 42]
POLL_LIMIT = 10_000


def wait_for(condition: Callable[[], bool]) -> None:
    """Poll the engine's own view (no sleeps, no clock): a bounded number of round trips."""
    for _ in range(POLL_LIMIT):
        if condition():
            return
    raise AssertionError("the engine never reached the expected state")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_server_info_reports_slimes_fields(client: Any, tiny_model: Path) -> None:
    # slime's external-engine mode reads /server_info (then /get_server_info) and compares
    # tp/pp/ep sizes etc. (slime/backends/sglang_utils/external.py, sglang_engine.py).
    for route in ("/server_info", "/get_server_info"):
        info = client.http.get(route).json()
        assert (info["tp_size"], info["dp_size"], info["pp_size"], info["ep_size"]) == (1, 1, 1, 1)
        assert info["model_path"] == str(tiny_model) and info["disaggregation_mode"] == "null"
        assert info["port"] == int(client.url.rsplit(":", 1)[1])
        assert isinstance(info["internal_states"], list)


def held_requests(client: Any, pool: ThreadPoolExecutor, rids: list[str]) -> list[Future[Any]]:
    """Requests queued behind an in-place pause, so they are in flight when aborted."""
    client.ok("/pause_generation", {"mode": "in_place"})
    futures = [pool.submit(client.post, "/generate", {"input_ids": PROMPT, "rid": rid,
                                                      "sampling_params": {"max_new_tokens": 4}}) for rid in rids]
    wait_for(lambda: client.info()["waiting_requests"] == len(rids))
    return futures


def test_abort_request_by_rid_and_all(client: Any) -> None:
    with ThreadPoolExecutor(3) as pool:
        a, b, c = held_requests(client, pool, ["rid-a", "rid-b", "rid-c"])
        got = client.ok("/abort_request", {"rid": "rid-b"})  # verl's and XTuner's body
        assert got["num_aborted"] == 1
        assert b.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert client.ok("/abort_request", {"rid": "no-such-rid"})["num_aborted"] == 0  # ignored, as SGLang does
        got = client.ok("/abort_request", {"rid": "", "abort_all": True})  # slime's end-of-rollout body
        assert got["num_aborted"] == 2
        for future in (a, c):
            assert future.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    client.ok("/continue_generation", {})
    refused = client.post("/abort_request", {})
    assert refused.status_code == 400 and "abort_all" in refused.json()["message"]


def test_release_and_resume_weights_and_kv_cache(client: Any, server: Any, kit: SimpleNamespace,
                                                 tiny_model: Path, model_root: Path) -> None:
    params = client.info()["params"]
    model_bytes = sum(4 * _numel(p["shape"]) for p in params.values())  # float32 model
    before = client.digests()
    rss_before = rss_bytes(server.pid)

    # verl's default: release everything ({"tags": null} / {}), then resume weights, update, resume kv_cache.
    got = client.ok("/release_memory_occupation", {})
    assert got["freed_bytes"] >= model_bytes and got["released"] == ["cuda_graph", "kv_cache", "weights"]
    rss_after = rss_bytes(server.pid)
    print(f"\nrelease weights: {got['freed_bytes']} tensor bytes freed; server RSS {rss_before} -> {rss_after} "
          f"({rss_before - rss_after} bytes)")
    for path in ("/generate", "/health_generate"):
        response = client.post(path, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        assert response.status_code == 503 and "released" in response.json()["message"], response.text
    refused = client.post("/update_weights_from_disk", {"model_path": str(tiny_model)})
    assert refused.status_code == 409 and "/resume_memory_occupation" in refused.json()["message"]
    assert client.post("/weightsync/digests", {"names": None}).status_code == 409

    got = client.ok("/resume_memory_occupation", {"tags": ["weights"]})
    assert got["allocated_bytes"] == model_bytes and got["released"] == ["cuda_graph", "kv_cache"]
    response = client.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 503 and "not restored" in response.json()["message"]
    assert client.digests() != before  # re-allocated empty: the weights are gone until an update

    weights = kit.perturbed(tiny_model, seed=50)
    directory = model_root / "hf-checkpoint-after-resume"
    kit.load_model(tiny_model, weights).save_pretrained(directory)
    client.ok("/update_weights_from_disk", {"model_path": str(directory), "weight_version": "after-resume"})
    assert client.digests() == {n: digest(t) for n, t in weights.items()}
    response = client.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 503 and "KV cache" in response.json()["message"]
    client.ok("/resume_memory_occupation", {"tags": ["kv_cache"]})
    client.ok("/resume_memory_occupation", {})  # the rest (cuda_graph)
    want, _ = kit.reference_greedy(kit.load_model(tiny_model, weights), PROMPT, 8)
    assert client.generate(PROMPT, sampling_params={"max_new_tokens": 8, "ignore_eos": True})["output_ids"] == want

    # A subset: the KV cache only; the weights stay as they are.
    served = client.digests()
    assert client.ok("/release_memory_occupation", {"tags": ["kv_cache"]})["freed_bytes"] == 0
    assert client.digests() == served
    client.ok("/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert client.generate(PROMPT, sampling_params={"max_new_tokens": 8, "ignore_eos": True})["output_ids"] == want


@pytest.mark.parametrize(("route", "body", "needle"), [
    ("/release_memory_occupation", {"tags": ["weight"]}, "unknown memory tag"),
    ("/release_memory_occupation", {"tags": "weights"}, "'tags'"),
    ("/resume_memory_occupation", {"tags": ["weights"]}, "not released"),
])
def test_memory_refusals_name_the_field(client: Any, route: str, body: dict[str, Any], needle: str) -> None:
    before = client.digests()
    response = client.post(route, body)
    assert 400 <= response.status_code < 500 and needle in response.json()["message"], response.text
    assert client.digests() == before


def _numel(shape: list[int]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count
