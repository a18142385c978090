"""LoRA over every transport into real `weightsync serve` engines: the engine's
adapter outputs equal PEFT's, differ from the base, and versions roll over
without failing or mixing requests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from contract_helpers import next_version

import weightsync as ws
from weightsync.server.launch import ServerProcess, launch_server

TRANSPORTS = ["http", "shm", "broadcast", "disk"]
PROMPTS = [[5, 17, 42, 7], [300, 2, 99], [11, 12, 13, 14, 15, 16]]
MAX_LOADED = 3


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir: Path, disk_root: Path) -> Iterator[ServerProcess]:
    args = ["--disk-root", str(disk_root), "--enable-lora", "--max-loaded-loras", str(MAX_LOADED)]
    with launch_server(tiny_model_dir, args=args) as server:
        yield server


def peft_trainer(model_dir: Path, seed: int) -> torch.nn.Module:
    """A PEFT LoRA model (all linear layers) with B set non-zero, so the adapter matters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    randomize_b(model, seed)
    return model.eval()


def randomize_b(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def loaded_loras(server: ServerProcess) -> list[str]:
    return list(httpx.get(f"{server.url}/weightsync/info").json()["loaded_loras"])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_adapter_outputs_equal_peft_and_differ_from_base(
    transport: str, lora_engine: ServerProcess, tiny_model_dir: Path, disk_root: Path
) -> None:
    model = peft_trainer(tiny_model_dir, seed=1)
    client = ws.SGLangEngine(lora_engine.url)
    with ws.WeightSync([client], transport=transport, mode="lora", disk_root=str(disk_root),
                       bucket_bytes=64 << 10, timeout_s=30) as sync:
        version = next_version()
        report = sync.push(model, version=version)
        assert report.verified and report.mode == "lora"
        assert sync.lora_name == f"policy-v{version}"
        # only adapter tensors travel: r * (in + out) per linear layer
        assert report.num_bytes == sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)
        assert all(n.startswith("base_model.model.") and ".default." not in n for a in report.acks
                   for n in a.loaded_names)
        adapted = ws.probe_logprobs(model, client, PROMPTS, max_new_tokens=6, lora_name=sync.lora_name)
        assert adapted.token_agreement == 1.0 and adapted.max_gap < 1e-4, adapted
        with model.disable_adapter():
            base = ws.probe_logprobs(model, client, PROMPTS, max_new_tokens=6)
            assert base.max_gap < 1e-4, "requests without lora_path use the base weights"
            crossed = ws.probe_logprobs(model, client, PROMPTS, max_new_tokens=6, lora_name=sync.lora_name)
        assert crossed.max_gap > 1e-2, "the adapter changes the outputs"


def test_rollover_under_concurrent_requests(lora_engine: ServerProcess, tiny_model_dir: Path) -> None:
    model = peft_trainer(tiny_model_dir, seed=2)
    client = ws.SGLangEngine(lora_engine.url)
    answers: list[dict] = []
    failures: list[str] = []
    stop = threading.Event()

    def clients(sync: ws.WeightSync) -> None:
        with httpx.Client(base_url=lora_engine.url, timeout=60) as http:
            while not stop.is_set():
                name = sync.lora_name
                r = http.post("/generate", json={"input_ids": PROMPTS[0], "lora_path": name,
                                                 "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
                if r.status_code != 200:
                    failures.append(f"{name}: {r.status_code} {r.text[:200]}")
                    continue
                answers.append({"asked": name, **r.json()["meta_info"]})

    with ws.WeightSync([client], transport="http", mode="lora", pause="retract", timeout_s=30) as sync:
        sync.push(model, version=next_version())
        threads = [threading.Thread(target=clients, args=(sync,)) for _ in range(3)]
        for t in threads:
            t.start()
        names = [sync.lora_name]
        try:
            for seed in range(3, 8):
                randomize_b(model, seed)
                sync.push(model, version=next_version())
                names.append(sync.lora_name)
                assert len(loaded_loras(lora_engine)) <= MAX_LOADED
        finally:
            stop.set()
            for t in threads:
                t.join()
    # close() waited for the retired adapters to unload
    assert failures == []
    loaded = loaded_loras(lora_engine)
    assert names[-1] in loaded and not set(names[:-1]) & set(loaded), "older versions were unloaded"
    assert len(answers) > 10
    for a in answers:
        assert a["lora_path"] == a["asked"], "each answer used the adapter it asked for"
        assert a["finish_reason"]["type"] == "length", "no request failed or was aborted"
    assert len({a["asked"] for a in answers}) >= 2, "requests ran across rollovers"


def test_exported_adapter_loads_in_the_engine_like_in_peft(
    lora_engine: ServerProcess, tiny_model_dir: Path, disk_root: Path
) -> None:
    model = peft_trainer(tiny_model_dir, seed=9)
    out = ws.export_lora_adapter(model, disk_root / "exported-adapter")
    http = httpx.Client(base_url=lora_engine.url, timeout=60)
    r = http.post("/load_lora_adapter", json={"lora_name": "exported", "lora_path": str(out)})
    assert r.status_code == 200, r.text
    try:
        with torch.no_grad():
            ids = torch.tensor([PROMPTS[2]])
            want = model.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        got = http.post("/generate", json={"input_ids": PROMPTS[2], "lora_path": "exported",
                                           "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                               "ignore_eos": True}}).json()
        assert got["output_ids"] == want
    finally:
        http.post("/unload_lora_adapter", json={"lora_name": "exported"})
        http.close()


@pytest.mark.parametrize("transport", ["http", "broadcast"])
def test_merged_lora_is_served_as_full_weights(
    transport: str, engines: list[ServerProcess], tiny_model_dir: Path, disk_root: Path
) -> None:
    model = peft_trainer(tiny_model_dir, seed=11)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    client = ws.SGLangEngine(engines[0].url)
    with ws.WeightSync([client], transport=transport, mode="lora-merged", bucket_bytes=200 << 10,
                       disk_root=str(disk_root), timeout_s=30) as sync:
        report = sync.push(model, version=next_version())
    assert report.verified and report.mode == "lora-merged"
    assert not any("lora_" in n for a in report.acks for n in a.loaded_names), "no LoRA tensor is sent"
    merged = ws.probe_logprobs(model, client, PROMPTS, max_new_tokens=6)  # PEFT, unmerged, adapter on
    assert merged.token_agreement == 1.0 and merged.max_gap < 1e-4, merged
    with model.disable_adapter():
        base = ws.probe_logprobs(model, client, PROMPTS, max_new_tokens=6)
    assert base.max_gap > 1e-2, "the engine serves merged weights, not the base"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "trainer left bit-identical"


def test_first_lora_push_syncs_a_different_base(tiny_model_dir: Path, disk_root: Path, tmp_path: Path) -> None:
    from weightsync.tiny import TinyModelConfig, make_tiny_model

    other_base = make_tiny_model(disk_root / "other-base", TinyModelConfig(seed=123))
    args = ["--disk-root", str(disk_root), "--enable-lora"]
    with launch_server(other_base, args=args) as server:
        client = ws.SGLangEngine(server.url)
        model = peft_trainer(tiny_model_dir, seed=4)  # trained on tiny_model_dir's base
        with ws.WeightSync([client], transport="http", mode="lora", timeout_s=30) as sync:
            first = sync.push(model, version=1)
            assert client.weight_version() == "1" and first.mode == "lora"
            with model.disable_adapter():
                assert ws.probe_logprobs(model, client, PROMPTS).max_gap < 1e-4, "base weights were synced"
            adapted = ws.probe_logprobs(model, client, PROMPTS, lora_name=sync.lora_name)
            assert adapted.max_gap < 1e-4 and adapted.token_agreement == 1.0
            randomize_b(model, 5)
            second = sync.push(model, version=2)
            assert second.num_bytes == first.num_bytes, "later pushes send only the adapter"
