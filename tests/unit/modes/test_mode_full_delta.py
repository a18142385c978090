"""mode="full" and mode="delta" as units: which tensors one push selects, judged by the digests of
the tensors as the engines hold them, and when it goes whole instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mode_planner import ModePlanner
from weightsync import EngineCapabilities, EngineError
from weightsync.modes import PushMode, Selection, make_mode


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    with torch.no_grad():
        m[1].weight.fill_(0.5)  # exactly representable in bfloat16
    return m


def names(selection: Selection) -> list[str]:
    return [m.hf_name for m in selection.metas]


def pushed(mode: PushMode, m: nn.Module, version: int, planner: ModePlanner) -> Selection:
    """select, then committed, as the coordinator calls them for a push every engine acks."""
    mode.prepare(m, version, planner)
    selection = mode.select(mode.source(m), version, planner)
    mode.committed(selection, version, planner)
    return selection


def test_the_first_push_is_whole_then_only_changed_tensors_go() -> None:
    m, mode, planner = model(), make_mode("delta"), ModePlanner()
    first = pushed(mode, m, 1, planner)
    assert first.mode == "full" and names(first) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    unchanged = pushed(mode, m, 2, planner)
    assert unchanged.mode == "delta" and names(unchanged) == [] and unchanged.num_skipped == 4
    assert unchanged.base_version == 1
    with torch.no_grad():
        m[0].bias[2] += 1.0
    changed = pushed(mode, m, 3, planner)
    assert names(changed) == ["0.bias"] and changed.num_skipped == 3 and changed.base_version == 2


def test_changes_are_judged_in_the_engines_dtype() -> None:
    """A change below bfloat16's resolution leaves the bytes a bf16 engine holds as they
    are: nothing to send; one above it is sent."""
    m, mode, planner = model(), make_mode("delta"), ModePlanner(cast_to=torch.bfloat16)
    pushed(mode, m, 1, planner)
    with torch.no_grad():
        m[1].weight[0, 0] += 2.0**-20  # 0.5 + 2**-20 rounds to 0.5 in bfloat16
    assert names(pushed(mode, m, 2, planner)) == []
    with torch.no_grad():
        m[1].weight[0, 0] += 2.0**-6
    assert names(pushed(mode, m, 3, planner)) == ["1.weight"]


def test_a_changed_tensor_takes_its_fused_group_along() -> None:
    fused = EngineCapabilities(fused_groups=(("0.weight", "1.weight"),))
    m, mode, planner = model(), make_mode("delta"), ModePlanner([fused])
    pushed(mode, m, 1, planner)
    with torch.no_grad():
        m[1].weight[0, 0] = 2.0
    assert names(pushed(mode, m, 2, planner)) == ["0.weight", "1.weight"]


def test_an_engine_that_applies_no_partial_update_gets_the_whole_model() -> None:
    m, mode = model(), make_mode("delta")
    planner = ModePlanner([EngineCapabilities(), EngineCapabilities(supports_delta=False)])
    pushed(mode, m, 1, planner)
    again = pushed(mode, m, 2, planner)
    assert again.mode == "full" and len(names(again)) == 4 and again.base_version is None


def test_a_refused_base_sends_the_same_push_whole() -> None:
    """409 at begin (the engine cannot prove it holds the base): select again, whole; the
    digests taken for this push are kept, so the next delta is against what it sent."""
    m, mode, planner = model(), make_mode("delta"), ModePlanner()
    pushed(mode, m, 1, planner)
    with torch.no_grad():
        m[0].bias[0] += 1.0
    mode.prepare(m, 2, planner)
    delta = mode.select(mode.source(m), 2, planner)
    assert names(delta) == ["0.bias"]
    assert not mode.refused(delta, EngineError("e", "bad request", status=400))
    assert mode.refused(delta, EngineError("e", "base v1 not held", status=409))
    whole = mode.select(mode.source(m), 2, planner)
    assert whole.mode == "full" and len(names(whole)) == 4
    assert not mode.refused(whole, EngineError("e", "base v1 not held", status=409))  # a whole push is not retried
    mode.committed(whole, 2, planner)
    assert names(pushed(mode, m, 3, planner)) == []


def test_full_sends_everything_every_push() -> None:
    m, mode, planner = model(), make_mode("full"), ModePlanner()
    for version in (1, 2):
        selection = pushed(mode, m, version, planner)
        assert selection.mode == "full" and names(selection) == ["0.weight", "0.bias", "1.weight", "1.bias"]
        assert selection.num_skipped == 0 and selection.base_version is None


def test_unknown_modes_are_refused_naming_the_valid_ones() -> None:
    valid = r"\['full', 'lora', 'lora-merged', 'delta', 'sparse'\]"
    with pytest.raises(ValueError, match=rf"unknown mode 'nccl'; one of {valid}"):
        make_mode("nccl")
