"""LoRA on a real `weightsync serve --enable-lora`: outputs equal PEFT's own
PeftModel (and differ from the base model), per-request routing, loading from
a directory, from tensors and through a weightsync lora session, LRU eviction,
unloading that waits for in-flight requests, and refusals."""

from __future__ import annotations

import base64
import hashlib
import json
import pickle
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from server_fixtures import make_adapter

# fixtures server, client, tiny_model, model_root, kit: tests/support/server_fixtures.py

PROMPT = [5, 17, 42, 99, 3]
MAX_NEW = 10


def peft_reference(base_dir: Path, adapter_dir: Path, kit: SimpleNamespace) -> tuple[list[int], list[float]]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(kit.load_model(base_dir), adapter_dir).eval()
    return kit.reference_greedy(model, PROMPT, MAX_NEW)


def adapter_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def server(tiny_model: Path, kit: SimpleNamespace, one_torch_thread: None) -> Iterator[Any]:
    yield from kit.start_server(tiny_model, "--enable-lora", "--max-loaded-loras", "2")


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, model_root: Path) -> dict[str, Path]:
    root = model_root / "adapters"
    return {
        "plain": make_adapter(tiny_model, root / "plain", seed=1),
        "rslora": make_adapter(tiny_model, root / "rslora", seed=2, r=8, use_rslora=True,
                               target_modules=["o_proj", "up_proj", "k_proj"], alpha_pattern={"up_proj": 3.0}),
        "other": make_adapter(tiny_model, root / "other", seed=3, target_modules="all-linear"),
    }


@pytest.fixture(autouse=True)
def unload_all(client: Any) -> Iterator[None]:
    yield
    for name in client.info()["loaded_loras"]:
        client.ok("/unload_lora_adapter", {"lora_name": name})


def generate(client: Any, lora: str | None) -> dict[str, Any]:
    return client.generate(PROMPT, sampling_params={"max_new_tokens": MAX_NEW, "ignore_eos": True},
                           return_logprob=True, lora_path=lora)


def assert_matches(answer: dict[str, Any], reference: tuple[list[int], list[float]]) -> None:
    tokens, logprobs = reference
    assert answer["output_ids"] == tokens
    got = [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("kind", ["plain", "rslora", "other"])
def test_adapter_from_directory_equals_peft(client: Any, adapters: dict[str, Path], tiny_model: Path,
                                            kit: SimpleNamespace, kind: str) -> None:
    base = kit.reference_greedy(kit.load_model(tiny_model), PROMPT, MAX_NEW)
    reference = peft_reference(tiny_model, adapters[kind], kit)
    assert reference[0] != base[0] or reference[1] != base[1]  # the adapter changes the output
    client.ok("/load_lora_adapter", {"lora_name": kind, "lora_path": str(adapters[kind])})
    answer = generate(client, kind)
    assert answer["meta_info"]["lora_path"] == kind
    assert_matches(answer, reference)
    assert_matches(generate(client, None), base)  # the base model is untouched


def test_adapter_from_tensors_equals_peft(client: Any, adapters: dict[str, Path], tiny_model: Path,
                                          kit: SimpleNamespace) -> None:
    tensors = adapter_tensors(adapters["plain"])
    config = json.loads((adapters["plain"] / "adapter_config.json").read_text())
    checksums = {n: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for n, t in tensors.items()}
    payload = base64.b64encode(pickle.dumps(list(tensors.items()))).decode()
    body = {"lora_name": "from-tensors", "config_dict": config, "serialized_named_tensors": [payload],
            "expected_checksums": checksums}
    bad = dict(checksums)
    first = next(iter(bad))
    bad[first] = "0" * 64
    response = client.post("/load_lora_adapter_from_tensors", {**body, "expected_checksums": bad})
    assert response.status_code == 400 and first in response.json()["message"]
    client.ok("/load_lora_adapter_from_tensors", body)
    assert_matches(generate(client, "from-tensors"), peft_reference(tiny_model, adapters["plain"], kit))


def test_requests_are_routed_per_adapter(client: Any, adapters: dict[str, Path], tiny_model: Path,
                                         kit: SimpleNamespace) -> None:
    client.ok("/load_lora_adapter", {"lora_name": "plain", "lora_path": str(adapters["plain"])})
    client.ok("/load_lora_adapter", {"lora_name": "rslora", "lora_path": str(adapters["rslora"])})
    names = ["plain", None, "rslora", "plain", None]
    answers = client.ok("/generate", {"input_ids": [PROMPT] * len(names), "lora_path": names, "return_logprob": True,
                                      "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW,
                                                          "ignore_eos": True}})
    references = {"plain": peft_reference(tiny_model, adapters["plain"], kit),
                  "rslora": peft_reference(tiny_model, adapters["rslora"], kit),
                  None: kit.reference_greedy(kit.load_model(tiny_model), PROMPT, MAX_NEW)}
    for name, answer in zip(names, answers, strict=True):
        assert answer["meta_info"]["lora_path"] == name
        assert_matches(answer, references[name])


def test_lru_eviction_skips_pinned_adapters(client: Any, adapters: dict[str, Path]) -> None:
    client.ok("/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["plain"]), "pinned": True})
    client.ok("/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["rslora"])})
    again = client.post("/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["rslora"])})
    assert again.status_code == 409 and "already loaded" in again.json()["message"]
    generate(client, "b")
    got = client.ok("/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["other"])})
    assert got["evicted"] == ["b"]  # "a" is pinned, so "b" goes although used more recently
    assert sorted(client.info()["loaded_loras"]) == ["a", "c"]
    response = client.post("/generate", {"input_ids": PROMPT, "lora_path": "b"})
    assert response.status_code == 400 and "'b' is not loaded" in response.json()["message"]


def test_unload_waits_for_in_flight_requests(client: Any, adapters: dict[str, Path]) -> None:
    client.ok("/load_lora_adapter", {"lora_name": "busy", "lora_path": str(adapters["plain"])})
    client.ok("/pause_generation", {"mode": "in_place"})
    with ThreadPoolExecutor(2) as pool:
        request = pool.submit(httpx.post, f"{client.url}/generate", timeout=60, json={
            "input_ids": PROMPT, "lora_path": "busy", "sampling_params": {"max_new_tokens": 4}})
        deadline = time.monotonic() + 30
        while client.info()["waiting_requests"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        unload = pool.submit(client.post, "/unload_lora_adapter", {"lora_name": "busy"})
        while "busy" in client.info()["loaded_loras"]:  # retiring: refused to new requests
            assert time.monotonic() < deadline
            time.sleep(0.005)
        refused = client.post("/generate", {"input_ids": PROMPT, "lora_path": "busy"})
        assert refused.status_code == 400
        assert not unload.done()  # generation is paused, so the request still holds the adapter
        client.ok("/continue_generation")
        assert request.result().json()["meta_info"]["finish_reason"]["type"] == "length"
        assert unload.result().status_code == 200


def test_lora_session_over_http_frames(client: Any, adapters: dict[str, Path], tiny_model: Path,
                                       kit: SimpleNamespace) -> None:
    version = client.version() + 1
    tensors = adapter_tensors(adapters["rslora"])
    config = json.loads((adapters["rslora"] / "adapter_config.json").read_text())
    manifest, buffers = kit.make_update(tensors, version=version, bucket_bytes=8_000, mode="lora")
    manifest = type(manifest)(version=version, mode="lora", buckets=manifest.buckets, lora_config=config,
                              lora_name=f"policy-v{version}")
    client.ok("/weightsync/begin", {"manifest": manifest.without_digests().to_dict()})
    for index, buffer in enumerate(buffers):
        client.ok("/weightsync/bucket", content=kit.frame(manifest, index, buffer))
    ack = client.ok("/weightsync/commit", {"version": version})["ack"]
    assert ack["version"] == version and ack["loaded_names"] == sorted(tensors)
    assert ack["digests"] == list(manifest.digests)
    assert client.version() == version
    assert_matches(generate(client, f"policy-v{version}"), peft_reference(tiny_model, adapters["rslora"], kit))


def test_unsupported_adapters_are_refused(client: Any, adapters: dict[str, Path], tiny_model: Path,
                                          model_root: Path) -> None:
    dora = make_adapter(tiny_model, model_root / "adapters" / "dora", seed=4, use_dora=True)
    response = client.post("/load_lora_adapter", {"lora_name": "dora", "lora_path": str(dora)})
    assert response.status_code == 400 and "DoRA" in response.json()["message"]
    embed = make_adapter(tiny_model, model_root / "adapters" / "embed", seed=5, target_modules=["embed_tokens"])
    response = client.post("/load_lora_adapter", {"lora_name": "embed", "lora_path": str(embed)})
    assert response.status_code == 400 and "Embedding" in response.json()["message"]
    tensors = adapter_tensors(adapters["plain"])
    name = next(iter(tensors))
    tensors[name] = tensors[name][:, :-1]
    config = json.loads((adapters["plain"] / "adapter_config.json").read_text())
    payload = base64.b64encode(pickle.dumps(list(tensors.items()))).decode()
    response = client.post("/load_lora_adapter_from_tensors", {"lora_name": "bad", "config_dict": config,
                                                               "serialized_named_tensors": [payload]})
    assert response.status_code == 400 and name in response.json()["message"]
    assert client.info()["loaded_loras"] == []


@pytest.mark.parametrize("transport", ["disk", "http", "shm", "broadcast"])
def test_weightsync_lora_push_with_the_sglang_client(client: Any, adapters: dict[str, Path], tiny_model: Path,
                                                     model_root: Path, kit: SimpleNamespace, transport: str) -> None:
    from peft import PeftModel

    import weightsync as wsync

    trainer = PeftModel.from_pretrained(kit.load_model(tiny_model), adapters["plain"]).eval()
    engine = wsync.SGLangEngine(client.url)
    version = client.version() + 1
    try:
        with wsync.WeightSync([engine], transport=transport, mode="lora", bucket_bytes=16 << 10,
                              disk_root=str(model_root / "lora-pushes"), timeout_s=30) as sync:
            report = sync.push(trainer, version=version)
            assert report.verified, report.notes
            assert sync.lora_name == f"policy-v{version}"
            probe = wsync.probe_logprobs(trainer, engine, [PROMPT], max_new_tokens=MAX_NEW, lora_name=sync.lora_name)
            assert probe.token_agreement == 1.0 and probe.max_gap < 1e-4, probe
    finally:
        engine.close()
    assert_matches(generate(client, f"policy-v{version}"), peft_reference(tiny_model, adapters["plain"], kit))
