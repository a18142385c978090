"""The streaming pipeline of a push (`weightsync.push.pipeline.stream_buckets`): the producer
packs while the caller delivers, and while its `first` call (the engines' begin) runs."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest
import torch

from torch_threads import torch_threads
from weightsync.bucketing import plan_buckets, unpack
from weightsync.manifest import BucketMeta, TensorMeta
from weightsync.push.packer import stream_order
from weightsync.push.pipeline import stream_buckets
from weightsync.reports import Stages

WEIGHTS = {f"w{i}": torch.full((4, 8), float(i)) for i in range(6)}


class DictSource:
    """A `WeightSource` over a dict of tensors."""

    mode = "full"

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta.of(n, t) for n, t in WEIGHTS.items()]

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in WEIGHTS if hf_names is None else hf_names:
            yield name, WEIGHTS[name]


def _plan() -> list[BucketMeta]:
    return plan_buckets([TensorMeta.of(n, t) for n, t in WEIGHTS.items()], 2 * 4 * 8 * 4)


def test_the_producer_packs_while_first_runs_and_delivery_waits_for_it() -> None:
    """`first` (the engines' begin) returns only once the producer has packed a bucket:
    it would wait forever if packing started after it; nothing is delivered before it returns."""
    plan = _plan()
    packed = threading.Event()
    events: list[str] = []

    def slot(index: int, nbytes: int) -> torch.Tensor:
        packed.set()
        return torch.empty(nbytes, dtype=torch.uint8)

    def first() -> None:
        assert packed.wait(timeout=60), "the producer did not start before first() returned"
        events.append("first")

    delivered: dict[str, torch.Tensor] = {}

    def deliver(bucket: BucketMeta, buffer: torch.Tensor) -> None:
        events.append(f"deliver {bucket.index}")
        delivered.update((n, t.clone()) for n, t in unpack(buffer, bucket))

    digests = stream_buckets(DictSource(), plan, stream_order(plan), None, slot=slot, deliver=deliver,
                             stages=Stages(), first=first)
    assert events == ["first", *(f"deliver {b.index}" for b in plan)]
    assert len(digests) == len(plan) == 3
    assert all(torch.equal(delivered[n], t) for n, t in WEIGHTS.items())


def test_when_first_raises_nothing_is_delivered_and_the_producer_stops() -> None:
    plan = _plan()
    slots: list[int] = []
    delivered: list[int] = []

    def slot(index: int, nbytes: int) -> torch.Tensor:
        slots.append(index)
        return torch.empty(nbytes, dtype=torch.uint8)

    def first() -> None:
        raise RuntimeError("begin refused")

    with pytest.raises(RuntimeError, match="begin refused"):
        stream_buckets(DictSource(), plan, stream_order(plan), None, slot=slot,
                       deliver=lambda b, _: delivered.append(b.index), stages=Stages(), first=first)
    assert delivered == []
    assert len(slots) <= 2, "at most the two slots in flight are packed before the producer stops"


def test_the_producer_packs_on_its_own_thread_count_and_leaves_the_callers() -> None:
    """`pack_threads` sets torch's intra-op threads of the producer thread alone while it
    packs: the caller's count is the same during the push and after it."""
    plan = _plan()
    seen: list[int] = []
    caller = torch.get_num_threads()

    class Counting(DictSource):
        def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
            for item in super().tensors(hf_names):
                seen.append(torch.get_num_threads())
                yield item

    def deliver(bucket: BucketMeta, buffer: torch.Tensor) -> None:
        seen.append(-torch.get_num_threads())  # the caller's thread, marked

    stream_buckets(Counting(), plan, stream_order(plan), None, slot=lambda _, n: torch.empty(n, dtype=torch.uint8),
                   deliver=deliver, stages=Stages(), pack_threads=1)
    assert {t for t in seen if t > 0} == {1}
    if torch.__config__.parallel_info().find("parallel backend: OpenMP") >= 0:  # counts are per thread
        assert {-t for t in seen if t < 0} == {caller}
    assert torch.get_num_threads() == caller


@pytest.mark.parametrize("threads", [1, 2])
def test_a_module_packed_with_grad_enabled_gets_no_graph(threads: int) -> None:
    """The producer packs under no_grad, where a module source yields its parameters
    themselves (no detached alias per tensor; outside no_grad it still yields detached
    ones): with the caller's grad enabled and every parameter requiring grad, the buckets
    are the parameters' bytes, no bucket buffer requires grad, and the parameters stay
    leaves with no grad, on one torch thread or two (runs on the helper thread)."""
    from weightsync.modes import make_mode

    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(5)), torch.nn.LayerNorm(16))
    with torch.no_grad():
        model[0].weight.data = model[0].weight.t().contiguous().t()  # one non-contiguous: packed on its own
    source = make_mode("full").source(model)
    plan = plan_buckets(source.metas(), 600)
    slots: list[torch.Tensor] = []

    def slot(index: int, nbytes: int) -> torch.Tensor:
        slots.append(torch.empty(nbytes, dtype=torch.uint8))
        return slots[-1]

    got: dict[str, torch.Tensor] = {}

    def deliver(bucket: BucketMeta, buffer: torch.Tensor) -> None:
        assert not buffer.requires_grad and buffer.grad_fn is None
        got.update((n, t.clone()) for n, t in unpack(buffer, bucket))

    with torch_threads(threads):
        assert torch.is_grad_enabled()
        stream_buckets(source, plan, stream_order(plan), None, slot=slot, deliver=deliver, stages=Stages())
    want = dict(model.state_dict())
    assert list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert all(not s.requires_grad and s.grad_fn is None for s in slots)
    assert all(p.is_leaf and p.requires_grad and p.grad is None for p in model.parameters())
    with torch.enable_grad():  # outside a push the source still yields detached aliases
        assert all(not t.requires_grad for _, t in source.tensors())
    with torch.no_grad():
        assert any(isinstance(t, torch.nn.Parameter) for _, t in source.tensors())
