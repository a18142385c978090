"""FSDP2 on 2 gloo ranks: the gathered stream equals the unsharded model bit for
bit, and gathered bytes alive at any moment stay within one bucket plus the
largest tensor."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from dist_util import init_gloo
from weightsync.bucketing import allocate, plan_buckets, unpack
from weightsync.integrity import byte_view
from weightsync.push.packer import pack_stream, stream_order
from weightsync.sources import ModuleSource
from weightsync.tiny import TinyModelConfig, build_model

BUCKET_BYTES = 96 << 10


class LiveBytes:
    """Counts bytes of tensors still alive (freed when their last reference goes)."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        n = tensor.untyped_storage().nbytes()
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(tensor.untyped_storage(), self._free, n)
        return tensor

    def _free(self, n: int) -> None:
        self.now -= n


def _worker(rank: int, world_size: int, init_file: str, tie: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init_gloo(rank, world_size, init_file)
    cfg = TinyModelConfig(num_layers=3, tie_word_embeddings=tie, vocab_size=640)
    reference = {k: v.clone() for k, v in build_model(cfg).state_dict().items()}
    model = build_model(cfg)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())

    source = ModuleSource(model)
    metas = source.metas()
    assert {m.hf_name for m in metas} == set(reference) - ({"lm_head.weight"} if tie else set())
    plan = plan_buckets(metas, BUCKET_BYTES)
    largest = max(m.nbytes for m in metas)
    live = LiveBytes()
    keep = rank == 0  # only the sending rank keeps the gathered bytes
    tensors = ((n, live.track(t)) for n, t in source.tensors(stream_order(plan)))
    seen = 0
    for bucket, buffer in pack_stream(plan, tensors, keep=keep, alloc=lambda b: live.track(allocate(b))):
        if keep:
            assert buffer is not None
            for name, t in unpack(buffer, bucket):
                ref = reference[name]
                assert t.dtype == ref.dtype and t.shape == ref.shape, name
                assert torch.equal(byte_view(t.contiguous()), byte_view(ref.contiguous())), name
                seen += 1
            del t  # views keep the bucket alive
        else:
            assert buffer is None
        del buffer
    # pack_stream's bound: one bucket plus the tensors in hand, the one its helper thread may still be
    # copying and the one just gathered (which comes first depends on the threads: a fresh clone's run
    # saw both at once), never the model
    model_bytes = sum(m.nbytes for m in metas)
    bound = max(b.nbytes for b in plan) + 2 * largest
    assert live.peak <= bound < model_bytes, (live.peak, bound, model_bytes)
    if keep:
        assert seen == len(metas)
    # Sharded parameters are untouched by reading.
    local = {n: p.to_local().clone() for n, p in model.named_parameters()}
    list(source.tensors())
    assert all(torch.equal(p.to_local(), local[n]) for n, p in model.named_parameters())
    dist.barrier()


def test_fsdp2_stream_equals_unsharded_state_dict(run_distributed) -> None:  # type: ignore[no-untyped-def]
    run_distributed(_worker, 2, False)


def test_fsdp2_stream_with_tied_embeddings(run_distributed) -> None:  # type: ignore[no-untyped-def]
    run_distributed(_worker, 2, True)
