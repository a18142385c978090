"""mode="sparse" as a unit: what one push selects and streams against the snapshot of
the acked version (bfloat16 engines), and when it goes whole."""

from __future__ import annotations

import torch
from torch import nn

from mode_planner import ModePlanner, as_engine_holds
from weightsync import EngineCapabilities, EngineError
from weightsync.integrity import digest
from weightsync.modes import Selection, make_mode

SPARSE = EngineCapabilities(supports_sparse=True)
NAMES = ["0.weight", "0.bias", "1.weight", "1.bias"]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8))


def planner(*capabilities: EngineCapabilities) -> ModePlanner:
    return ModePlanner(capabilities or [SPARSE], cast_to=torch.bfloat16)


def streamed(selection: Selection) -> dict[str, torch.Tensor]:
    assert selection.stream is not None
    return {n: t.clone() for n, t in selection.stream.tensors([m.hf_name for m in selection.metas])}


def test_first_push_whole_then_only_changed_elements_with_whole_tensor_digests() -> None:
    m, mode, p = model(), make_mode("sparse"), planner()
    first = mode.select(mode.source(m), 1, p)
    assert first.mode == "full" and [x.hf_name for x in first.metas] == NAMES
    for hf_name, tensor in streamed(first).items():  # the stream is the cast tensors, bit for bit
        assert torch.equal(tensor, as_engine_holds(m.get_parameter(hf_name), torch.bfloat16)), hf_name
    mode.committed(first, 1, p)

    unchanged = mode.select(mode.source(m), 2, p)
    assert unchanged.mode == "sparse" and list(unchanged.metas) == [] and unchanged.num_skipped == 4
    assert unchanged.base_version == 1
    mode.committed(unchanged, 2, p)

    with torch.no_grad():
        m[0].weight[3, 5] += 1.0
        m[0].weight[7, 0] -= 1.0
    changed = mode.select(mode.source(m), 3, p)
    (meta,) = changed.metas
    assert meta.hf_name == "0.weight" and meta.dtype == torch.bfloat16 and meta.num_changed == 2
    assert meta.tensor_digest == digest(as_engine_holds(m[0].weight, torch.bfloat16))
    payload = streamed(changed)["0.weight"]
    assert payload.dtype == torch.uint8 and payload.numel() < m[0].weight.numel() * 2  # less than the dense tensor
    assert changed.base_version == 2 and changed.num_skipped == 3


def test_a_refused_base_sends_the_whole_model_of_the_same_version() -> None:
    m, mode, p = model(), make_mode("sparse"), planner()
    mode.committed(mode.select(mode.source(m), 1, p), 1, p)
    with torch.no_grad():
        m[1].bias[0] += 1.0
    sparse = mode.select(mode.source(m), 2, p)
    assert sparse.mode == "sparse" and [x.hf_name for x in sparse.metas] == ["1.bias"]
    assert not mode.refused(sparse, EngineError("e", "bad request", status=400))
    assert mode.refused(sparse, EngineError("e", "base v1 not held", status=409))
    whole = mode.select(mode.source(m), 2, p)
    assert whole.mode == "full" and [x.hf_name for x in whole.metas] == NAMES
    assert torch.equal(streamed(whole)["1.bias"], as_engine_holds(m[1].bias, torch.bfloat16))


def test_after_a_failed_push_the_next_one_is_whole() -> None:
    """The snapshot took the failed push's values, which no engine may hold."""
    m, mode, p = model(), make_mode("sparse"), planner()
    mode.committed(mode.select(mode.source(m), 1, p), 1, p)
    with torch.no_grad():
        m[1].bias[0] += 1.0
    assert mode.select(mode.source(m), 2, p).mode == "sparse"
    mode.failed(2)  # never committed
    again = mode.select(mode.source(m), 3, p)
    assert again.mode == "full" and [x.hf_name for x in again.metas] == NAMES


def test_an_engine_that_applies_no_sparse_update_gets_whole_pushes() -> None:
    m, mode, p = model(), make_mode("sparse"), planner(SPARSE, EngineCapabilities())
    for version in (1, 2):
        selection = mode.select(mode.source(m), version, p)
        assert selection.mode == "full" and [x.hf_name for x in selection.metas] == NAMES
        mode.committed(selection, version, p)
