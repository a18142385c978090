"""LoRA over every transport into real `weightsync serve` engines: the engine's
adapter outputs equal PEFT's, differ from the base, and versions roll over
without failing or mixing requests."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

import weightsync as ws
from contract_helpers import next_version
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


def unload_all(server: ServerProcess) -> None:
    """Start from an engine without adapters (earlier tests leave their current one loaded)."""
    for name in loaded_loras(server):
        httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": name}, timeout=60).raise_for_status()


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


def _generate(url: str, lora_name: str | None) -> dict:
    """One request naming `lora_name`, as a rollout client sends it; its answer or failure."""
    response = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": PROMPTS[0], "lora_path": lora_name,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
    if response.status_code != 200:
        return {"asked": lora_name, "failed": f"{response.status_code} {response.text[:200]}"}
    return {"asked": lora_name, **response.json()["meta_info"]}


def test_rollover_under_concurrent_requests(lora_engine: ServerProcess, tiny_model_dir: Path) -> None:
    """The README's lifecycle: a name read from `sync.lora_name` stays servable until the
    second push after it became current commits (lora_keep=2, the default). Each round a
    client holds the current name, sends requests with it WHILE the next push runs and
    AFTER it committed (the name is then no longer current): every one is answered by the
    adapter it named. Deterministic: the name can only go once the round after has pushed."""
    unload_all(lora_engine)
    model = peft_trainer(tiny_model_dir, seed=2)
    client = ws.SGLangEngine(lora_engine.url)  # as the README builds it
    answers: list[dict] = []
    with ws.WeightSync([client], transport="http", mode="lora") as sync, ThreadPoolExecutor(4) as pool:
        sync.push(model, version=next_version())
        names = [sync.lora_name]
        for seed in range(3, 8):
            held = sync.lora_name
            randomize_b(model, seed)
            during = [pool.submit(_generate, lora_engine.url, held) for _ in range(3)]
            sync.push(model, version=next_version())
            after = pool.submit(_generate, lora_engine.url, held)
            answers += [f.result() for f in (*during, after)]
            names.append(sync.lora_name)
            loaded = loaded_loras(lora_engine)
            assert set(loaded) <= set(names) and len(loaded) <= MAX_LOADED, loaded
            assert {names[-2], names[-1]} <= set(loaded), "the current and the previous name stay loaded"
    assert [a for a in answers if "failed" in a] == []
    for a in answers:
        assert a["lora_path"] == a["asked"], "each answer used the adapter it asked for"
        assert a["finish_reason"]["type"] == "length", "no request failed or was aborted"
    assert len({a["asked"] for a in answers}) == 5
    # close() waited for the retired adapters to unload: exactly the last lora_keep are left
    assert sorted(loaded_loras(lora_engine)) == sorted(names[-2:])


class _FlakyUnloads(ws.SGLangEngine):
    """Fault injection: the first `failures` unloads fail as an overloaded engine's would."""

    def __init__(self, url: str, failures: int) -> None:
        super().__init__(url)
        self.failures = failures

    def unload_lora(self, lora_name: str, *, timeout_s: float | None = None) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise ws.EngineError(self.label, f"injected: unloading {lora_name} failed", status=503)
        super().unload_lora(lora_name, timeout_s=timeout_s)


def test_a_failed_unload_is_retried_and_never_leaks(lora_engine: ServerProcess, tiny_model_dir: Path) -> None:
    unload_all(lora_engine)
    model = peft_trainer(tiny_model_dir, seed=12)
    client = _FlakyUnloads(lora_engine.url, failures=2)
    with ws.WeightSync([client], transport="http", mode="lora", lora_keep=1) as sync:
        names = []
        for seed in range(13, 17):
            randomize_b(model, seed)
            sync.push(model, version=next_version())
            names.append(sync.lora_name)
    assert client.failures == 0, "the injected failures happened"
    assert loaded_loras(lora_engine) == [names[-1]], "every retired name was unloaded in the end"


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
            want = model.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[
                0, ids.shape[1] :
            ].tolist()
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
            checkpoint = load_file(tiny_model_dir / "model.safetensors")
            assert [p.mode for p in first.phases] == ["full"] and first.phases[0].verified
            assert first.phases[0].num_bytes == sum(t.numel() * t.element_size() for t in checkpoint.values()), \
                "the report counts the base weights re-synced as the push's first phase"
            with model.disable_adapter():
                assert ws.probe_logprobs(model, client, PROMPTS).max_gap < 1e-4, "base weights were synced"
            adapted = ws.probe_logprobs(model, client, PROMPTS, lora_name=sync.lora_name)
            assert adapted.max_gap < 1e-4 and adapted.token_agreement == 1.0
            randomize_b(model, 5)
            second = sync.push(model, version=2)
            assert second.num_bytes == first.num_bytes, "later pushes send only the adapter"
