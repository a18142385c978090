"""mode="lora" and mode="lora-merged" as units on a tiny PEFT model (LoRA B non-zero):
what a push selects, when the base weights are pushed first, and how adapter names
retire."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from mode_planner import ModePlanner
from weightsync import AdapterNotLoadedError, EngineCapabilities, EngineError
from weightsync.modes import ModeOptions, make_mode
from weightsync.tiny import TinyModelConfig, build_model

DIGESTS = EngineCapabilities(reads_digests=True)


def peft_model() -> nn.Module:
    model = get_peft_model(build_model(TinyModelConfig(num_layers=1, seed=0)),
                           LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def base_digests(model: nn.Module) -> dict[str, str]:
    """What an engine serving the trainer's base weights reports."""
    return ModePlanner().hash_tensors(make_mode("full").source(model), cast=False)


class Unloader:
    """An engine that unloads adapters by name and records each call; `fail` names
    adapters it refuses to unload, `gone` those it already dropped."""

    def __init__(self, *, fail: Iterable[str] = (), gone: Iterable[str] = ()) -> None:
        self.fail, self.gone = set(fail), set(gone)
        self.unloaded: list[str] = []

    def unload_lora(self, lora_name: str, *, timeout_s: float | None = None) -> None:
        if lora_name in self.fail:
            raise EngineError("unloader", f"cannot unload {lora_name} now", status=503)
        if lora_name in self.gone:
            raise AdapterNotLoadedError("unloader", f"no adapter {lora_name}", status=404)
        self.unloaded.append(lora_name)


def test_a_lora_push_selects_the_adapter_uncast_under_a_versioned_name() -> None:
    model = peft_model()
    mode = make_mode("lora", ModeOptions(lora_prefix="run7"))
    assert not mode.casts and mode.sends_adapter
    selection = mode.select(mode.source(model), 12, ModePlanner(cast_to=torch.bfloat16))
    assert selection.mode == "lora" and selection.lora_name == "run7-v12"
    hf_names = [m.hf_name for m in selection.metas]
    assert hf_names and all("lora_A" in n or "lora_B" in n for n in hf_names)
    assert {m.dtype for m in selection.metas} == {torch.float32}
    assert selection.lora_config is not None and selection.lora_config["r"] == 2
    with pytest.raises(TypeError, match="mode='lora' needs a source with an adapter config"):
        mode.select(make_mode("full").source(model), 13, ModePlanner())


def test_the_base_is_pushed_first_only_where_an_engine_serves_other_weights() -> None:
    model = peft_model()
    mode = make_mode("lora")

    def first(version: int, planner: ModePlanner) -> list[str]:
        """The modes `prepare` asks to push first, as phases of the push of `version`."""
        return [m.name for m in mode.prepare(model, version, planner)]

    same = ModePlanner([DIGESTS], served=[base_digests(model)], instances=["pid-1"])
    assert first(1, same) == []
    other = dict(base_digests(model))
    other[next(iter(other))] = "0" * 16
    differs = ModePlanner([DIGESTS], served=[other], instances=["pid-1"])
    assert first(2, differs) == [], "checked once while the engines are the same processes"
    differs.instances = ["pid-2"]  # an engine restarted: it serves its checkpoint again
    assert first(3, differs) == ["full"]
    mode.failed(3)
    assert first(4, differs) == ["full"], "after a failed push the base is checked again"
    blind = ModePlanner([EngineCapabilities()])  # no engine reports digests: nothing to check
    assert [m.name for m in make_mode("lora").prepare(model, 1, blind)] == []


def test_adapter_names_retire_keep_pushes_later_on_every_engine() -> None:
    model = peft_model()
    first, second = Unloader(), Unloader(gone={"policy-v1"})
    planner = ModePlanner(unloaders=[first, second])
    mode = make_mode("lora", ModeOptions(lora_keep=2))
    for version in (1, 2, 3):
        mode.committed(mode.select(mode.source(model), version, planner), version, planner)
        assert mode.lora_name == f"policy-v{version}"
    mode.close(planner)  # waits for the background unloads
    assert first.unloaded == ["policy-v1"] and second.unloaded == []  # already gone counts as unloaded
    assert mode.rollover.live == ("policy-v2", "policy-v3") and mode.rollover.due == ()


def test_an_unload_that_fails_is_retried_until_it_succeeds() -> None:
    model = peft_model()
    engine = Unloader(fail={"policy-v1"})
    planner = ModePlanner(unloaders=[engine])
    mode = make_mode("lora", ModeOptions(lora_keep=1))
    for version in (1, 2):
        mode.committed(mode.select(mode.source(model), version, planner), version, planner)
    mode.rollover.finish([engine], timeout_s=10.0)
    assert mode.rollover.due == ("policy-v1",) and engine.unloaded == []
    engine.fail.clear()
    mode.close(planner)
    assert mode.rollover.due == () and engine.unloaded == ["policy-v1"]
    with pytest.raises(ValueError, match="lora_keep must be at least 1, got 0"):
        make_mode("lora", ModeOptions(lora_keep=0))


def test_lora_merged_sends_the_base_names_every_push_and_refuses_a_plain_model() -> None:
    model = peft_model()
    mode, planner = make_mode("lora-merged"), ModePlanner()
    base_names = [m.hf_name for m in make_mode("full").source(model).metas()]
    for version in (1, 2):
        selection = mode.select(mode.source(model), version, planner)
        assert selection.mode == "lora-merged" and [m.hf_name for m in selection.metas] == base_names
        assert selection.num_skipped == 0 and selection.lora_name is None
    with pytest.raises(ValueError, match="Sequential is not a PEFT model"):
        mode.source(nn.Sequential(nn.Linear(2, 2)))


class BusyUnloader(Unloader):
    """An engine whose unload of `busy` waits, as an engine's does while a request still uses
    the adapter, until `request_done` is set."""

    def __init__(self, busy: str) -> None:
        super().__init__()
        self.busy, self.waiting, self.request_done = busy, threading.Event(), threading.Event()

    def unload_lora(self, lora_name: str, *, timeout_s: float | None = None) -> None:
        if lora_name == self.busy:
            self.waiting.set()
            assert self.request_done.wait(timeout=30), "the test never ended the request"
        super().unload_lora(lora_name, timeout_s=timeout_s)


def test_a_name_retired_while_an_earlier_unload_waits_goes_when_that_wait_ends() -> None:
    """keep=1: policy-v1 retires at v2's commit and its unload waits for a request; v2 retires
    at v3's commit meanwhile. Once the request ends both go, with no further push and no
    close (the background round took v2 along instead of leaving it to the next push)."""
    model = peft_model()
    engine = BusyUnloader("policy-v1")
    planner = ModePlanner(unloaders=[engine])
    mode = make_mode("lora", ModeOptions(lora_keep=1))
    for version in (1, 2):
        mode.committed(mode.select(mode.source(model), version, planner), version, planner)
    assert engine.waiting.wait(timeout=30), "policy-v1's unload never started"
    mode.committed(mode.select(mode.source(model), 3, planner), 3, planner)  # v2 retires during v1's wait
    assert set(mode.rollover.due) == {"policy-v1", "policy-v2"}
    engine.request_done.set()
    deadline = time.monotonic() + 30  # a hang's bound: both unloads take no time once the request ended
    while mode.rollover.due and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mode.rollover.due == () and engine.unloaded == ["policy-v1", "policy-v2"]
    assert mode.rollover.live == ("policy-v3",)
    mode.close(planner)
    assert engine.unloaded == ["policy-v1", "policy-v2"]


def test_after_a_failed_streamed_push_the_base_goes_whole_though_its_digests_match() -> None:
    """commit="streamed": a base phase that failed after its last bucket loaded leaves an engine
    whose digests are the trainer's but which refuses generation until a full push lands. The
    push after the failure sends the base first without asking digests; staged pushes keep
    the digest check (the engine kept its last version)."""
    model = peft_model()
    same = ModePlanner([DIGESTS], served=[base_digests(model)], instances=["pid-1"])
    streamed = make_mode("lora", ModeOptions(commit="streamed"))
    assert [m.name for m in streamed.prepare(model, 1, same)] == []
    streamed.failed(1)
    assert [m.name for m in streamed.prepare(model, 2, same)] == ["full"]
    assert [m.name for m in streamed.prepare(model, 3, same)] == [], "once the base went, digests rule again"
    staged = make_mode("lora")
    assert [m.name for m in staged.prepare(model, 1, same)] == []
    staged.failed(1)
    assert [m.name for m in staged.prepare(model, 2, same)] == []
