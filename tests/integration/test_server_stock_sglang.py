"""`ws.SGLangEngine` against a server that speaks only SGLang's own API, as a stock
SGLang does: `weightsync serve --sglang-only` (every `/weightsync/*` route is 404).

What a user of a stock SGLang gets: the engine declares broadcast and disk (LoRA
from disk), no deltas, no digests; pushes land and the engine serves the sent
weights, reported `verified=False` with the reason; a transport the engine does
not take is refused naming it, before any byte moves.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

import weightsync as ws
from weightsync.errors import EngineError
from weightsync.server.launch import ServerProcess, launch_server

PROMPTS = [[5, 17, 42, 7], [300, 2, 99]]


@pytest.fixture(scope="module")
def disk_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stock-disk-root")


@pytest.fixture(scope="module")
def stock(tiny_model_dir: Path, disk_root: Path) -> Iterator[ServerProcess]:
    server = launch_server(tiny_model_dir, args=["--sglang-only", "--enable-lora", "--disk-root", str(disk_root)])
    try:
        yield server
    finally:
        server.close()


def trainer(model_dir: Path, seed: int) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def assert_serves(model: torch.nn.Module, client: ws.SGLangEngine, version: int,
                  lora_name: str | None = None) -> None:
    result = ws.probe_logprobs(model, client, PROMPTS, max_new_tokens=6, lora_name=lora_name)
    assert result.token_agreement == 1.0 and result.max_gap < 1e-4, result
    assert set(result.weight_versions) == {str(version)}


def test_it_is_a_stock_sglang_surface(stock: ServerProcess) -> None:
    assert httpx.get(f"{stock.url}/weightsync/info").status_code == 404
    caps = ws.SGLangEngine(stock.url).capabilities(timeout_s=30)
    assert caps.transports == {"broadcast", "disk"} and caps.lora_transports == {"disk"}
    assert not (caps.supports_delta or caps.reads_digests or caps.stages_updates)


@pytest.mark.parametrize("transport", ["broadcast", "disk"])
def test_pushes_land_unverified_with_the_reason(stock: ServerProcess, tiny_model_dir: Path, disk_root: Path,
                                                transport: str) -> None:
    client = ws.SGLangEngine(stock.url)
    version = int(client.weight_version()) + 1
    model = trainer(tiny_model_dir, seed=version)
    with ws.WeightSync([client], transport=transport, disk_root=str(disk_root), bucket_bytes=200 << 10,
                       timeout_s=30) as sync:
        report = sync.push(model, version=version)
    assert not report.verified and report.num_buckets > 1
    assert any("reports no digests" in note for note in report.notes), report.notes
    assert_serves(model, client, version)


def test_delta_goes_out_whole(stock: ServerProcess, tiny_model_dir: Path) -> None:
    client = ws.SGLangEngine(stock.url)
    version = int(client.weight_version()) + 1
    model = trainer(tiny_model_dir, seed=100 + version)
    with ws.WeightSync([client], transport="broadcast", mode="delta", timeout_s=30) as sync:
        sync.push(model, version=version)
        with torch.no_grad():
            model.model.norm.weight.add_(0.5)
        second = sync.push(model, version=version + 1)
    assert second.mode == "full" and second.num_skipped == 0, "a stock SGLang cannot prove its base version"
    assert_serves(model, client, version + 1)


def test_a_transport_it_does_not_take_is_refused_before_any_byte_moves(stock: ServerProcess,
                                                                       tiny_model_dir: Path) -> None:
    client = ws.SGLangEngine(stock.url)
    before = client.weight_version()
    model = trainer(tiny_model_dir, seed=7)
    with ws.WeightSync([client], transport="http", timeout_s=30) as sync, \
            pytest.raises(EngineError, match=r"over \['broadcast', 'disk'\], not transport='http'"):
        sync.push(model, version=int(before) + 1)
    assert client.weight_version() == before


def test_a_relay_is_refused_at_the_handshake_naming_the_engine(stock: ServerProcess, tiny_model_dir: Path) -> None:
    """`ws.SGLangEngine(url)` is the line for a stock SGLang and for `weightsync serve`, so the
    client passes the relay's check when the WeightSync is built; the stock engine declares no
    `relays` at the handshake and is refused there, named, before any begin. What only
    `weightsync serve` does is not on this client: asking for it names the engine and the fix."""
    client = ws.SGLangEngine(stock.url)
    before = client.weight_version()
    with ws.WeightSync([client], transport="broadcast", fan_out="relay", timeout_s=30) as sync, \
            pytest.raises(EngineError, match=f"{stock.url}.*no `relays` capability: a stock SGLang cannot relay"):
        sync.push(trainer(tiny_model_dir, seed=9), version=int(before) + 1)
    assert client.weight_version() == before
    assert client.extension(30.0) is None
    with pytest.raises(EngineError, match="stock SGLang server.*need `weightsync serve`"):
        client.digests()


def test_lora_goes_by_disk_and_only_by_disk(stock: ServerProcess, tiny_model_dir: Path, disk_root: Path) -> None:
    from peft import LoraConfig, get_peft_model

    client = ws.SGLangEngine(stock.url)
    version = int(client.weight_version()) + 1
    base = trainer(tiny_model_dir, seed=version)
    with ws.WeightSync([client], transport="broadcast", timeout_s=30) as sync:
        sync.push(base, version=version)  # the engine serves the trainer's base
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    with ws.WeightSync([client], transport="disk", mode="lora", disk_root=str(disk_root), timeout_s=30) as sync:
        report = sync.push(model, version=version)
        assert report.mode == "lora" and not report.verified
        assert_serves(model, client, version, lora_name=sync.lora_name)
    with ws.WeightSync([client], transport="broadcast", mode="lora", timeout_s=30) as sync, \
            pytest.raises(EngineError, match=r"over \['disk'\], not transport='broadcast'"):
        sync.push(model, version=version + 1)
