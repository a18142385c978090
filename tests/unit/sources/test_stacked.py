"""`sources.stacked`: a per-expert trainer's tensors streamed as the fused ones (`bucketing.TensorParts`),
packed part by part into the bucket exactly as the fused trainer's own tensors pack, cast as
`.to()` casts, with the trainer's parameters themselves as the parts (no copy of a layer)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from moe_models import CheckpointTensors, per_expert_trainer
from weightsync.bucketing import TensorParts, plan_buckets
from weightsync.errors import CastError
from weightsync.manifest import TensorMeta
from weightsync.modes import make_source, named_weights
from weightsync.push.packer import pack_stream, stream_order
from weightsync.sources import ModuleSource, StackedSource, stacked_source
from weightsync.tiny import TinyModelConfig, build_model


def trainers(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(fused transformers-5 model, the same weights held one expert at a time)."""
    fused = build_model(TinyModelConfig(arch="qwen3_moe"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in fused.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return fused, per_expert_trainer(fused)


def packed(source: object, metas: list[TensorMeta], bucket_bytes: int) -> list[bytes]:
    plan = plan_buckets(metas, bucket_bytes)
    return [bytes(buffer.numpy()) for _, buffer in pack_stream(plan, source.tensors(stream_order(plan)))]  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bucket_bytes", [1 << 12, 1 << 20])
def test_stacked_buckets_are_the_fused_trainers_byte_for_byte(dtype: torch.dtype, bucket_bytes: int) -> None:
    fused, per_expert = trainers()
    stacked = make_source(per_expert, expert_layout="fused")
    reference = ModuleSource(fused, expert_layout="fused")
    assert isinstance(stacked, StackedSource)
    assert stacked.metas() == reference.metas()  # names, order, dtypes, shapes
    metas = [replace(m, dtype=dtype) for m in reference.metas()]
    assert packed(stacked, metas, bucket_bytes) == packed(reference, metas, bucket_bytes)


def test_a_stream_in_mixtrals_checkpoint_names_goes_as_the_model_holds_it() -> None:
    """Mixtral's checkpoint names its router and experts `block_sparse_moe.` (transformers renames
    them `mlp.` on load): a stream of them is stacked and renamed to the fused model's names,
    in its order, byte for byte."""
    fused = build_model(TinyModelConfig(arch="mixtral"))
    stream = CheckpointTensors(named_weights(fused, expert_layout="per-expert"))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in stream.held
    stacked = stacked_source(stream, conversions_of=fused)
    reference = ModuleSource(fused, expert_layout="fused")
    assert stacked.metas() == reference.metas()
    assert packed(stacked, reference.metas(), 1 << 14) == packed(reference, reference.metas(), 1 << 14)
    assert [n for n, _ in stacked.tensors(["model.layers.1.mlp.gate.weight"])] == ["model.layers.1.mlp.gate.weight"]


def test_parts_are_the_trainers_parameters_in_memory_order() -> None:
    _, per_expert = trainers()
    params = dict(per_expert.named_parameters())
    source = make_source(per_expert, expert_layout="fused")
    seen = []
    for _, tensor in source.tensors(["model.layers.1.mlp.experts.gate_up_proj"]):
        assert isinstance(tensor, TensorParts) and tensor.shape == (8, 128, 128) and tensor.part_shape == (64, 128)
        for part_name, part in tensor:
            assert part.data_ptr() == params[part_name].data_ptr(), "a part is the parameter, not a copy"
            seen.append(part_name)
    assert seen == [f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up")]


def test_named_weights_assembles_the_fused_tensors() -> None:
    fused, per_expert = trainers(seed=1)
    assert {n: t for n, t in named_weights(per_expert, expert_layout="fused")}.keys() == dict(
        fused.named_parameters()).keys()
    for (name, tensor), (fused_name, param) in zip(named_weights(per_expert, expert_layout="fused"),
                                                   fused.named_parameters(), strict=True):
        assert name == fused_name and torch.equal(tensor, param), name


def test_an_overflowing_cast_names_the_expert() -> None:
    _, per_expert = trainers()
    with torch.no_grad():
        per_expert.model.layers[0].mlp.experts[3].up_proj.weight[0, 0] = 1e6  # beyond float16's 65504
    source = make_source(per_expert, expert_layout="fused")
    metas = [replace(m, dtype=torch.float16) for m in source.metas()]
    with pytest.raises(CastError, match=r"'model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight' from torch\.float32"):
        packed(source, metas, 1 << 20)


class Stream:
    """Named tensors in hand, counting the ones read."""

    mode = "full"

    def __init__(self, held: dict[str, torch.Tensor]) -> None:
        self.held = held
        self.read: list[str] = []

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(hf_name=n, dtype=t.dtype, shape=tuple(t.shape)) for n, t in self.held.items()]

    def tensors(self, hf_names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name in list(self.held) if hf_names is None else hf_names:
            self.read.append(hf_name)
            yield hf_name, self.held[hf_name]


def test_a_rank_that_packs_nothing_still_reads_every_part() -> None:
    fused, _ = trainers()
    stream = Stream(dict(named_weights(fused)))
    source = stacked_source(stream, conversions_of=fused)
    plan = plan_buckets(source.metas(), 1 << 14)
    assert [buffer for _, buffer in pack_stream(plan, source.tensors(stream_order(plan)), keep=False)] \
        == [None] * len(plan)
    assert sorted(stream.read) == sorted(stream.held)  # every per-expert tensor (an FSDP2 gather each)
    stream.read.clear()
    assert len(list(source.tensors())) == 25  # a consumer that reads no part
    assert sorted(stream.read) == sorted(stream.held)


def test_parts_of_another_dtype_or_shape_are_refused_by_name() -> None:
    fused, _ = trainers()
    held = dict(named_weights(fused))
    held["model.layers.1.mlp.experts.4.down_proj.weight"] = held["model.layers.1.mlp.experts.4.down_proj.weight"].half()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj stacks .*experts\.4\.down_proj"):
        stacked_source(Stream(held), conversions_of=fused).metas()


def test_tensor_parts_count() -> None:
    parts = TensorParts(iter([("a", torch.zeros(2, 3))]), shape=(2, 2, 3), part_shape=(2, 3))
    assert parts.num_parts == 2
    with pytest.raises(ValueError, match="ended after 1 of 2"):
        parts.drain()
    with pytest.raises(ValueError, match="not made of parts"):
        TensorParts(iter([]), shape=(2, 5), part_shape=(3,))
    whole = TensorParts(iter([("a", torch.ones(3)), ("b", torch.full((3,), 2.0))]), shape=(2, 3), part_shape=(3,))
    assert torch.equal(whole.assemble(), torch.tensor([[1.0] * 3, [2.0] * 3]))


def test_send_shares_reads_no_rows_of_a_stacked_tensor() -> None:
    fused, per_expert = trainers()
    source = make_source(per_expert, expert_layout="fused")
    assert source.param("model.norm.weight") is per_expert.model.norm.weight  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj is stacked .*use send_shares=False"):
        source.param("model.layers.0.mlp.experts.gate_up_proj")  # type: ignore[attr-defined]
    stream = stacked_source(Stream(dict(named_weights(fused))), conversions_of=fused)
    with pytest.raises(ValueError, match="push the model"):
        stream.param("model.norm.weight")  # type: ignore[attr-defined]
