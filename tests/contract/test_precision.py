"""Trainer precision is not engine precision: an fp32 trainer pushes to bf16 engines
of every kind (the embedded engine serving a bf16 checkpoint; a real vLLM started
with `--dtype bfloat16`, this machine's CPU has AVX512-BF16), over every transport
the kind declares.

Engines are built as the README builds them (default options): the push learns each
engine's dtype, checks that replicas agree, and casts floating tensors bucket by
bucket in the stream. Every engine acks the digests of `trainer_tensor.to(bfloat16)`
as sent and answers as transformers does with those bf16 weights; an engine that
reads its digests serves them bit for bit (the embedded one also over SGLang's
`/get_weights_by_name`). Disagreeing replicas and casts that overflow are refused
and leave every engine on its last version.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

import weightsync as ws
from contract_helpers import PROBE_PROMPTS, load_trainer, next_version, perturb, served_state
from engine_matrix import EMBEDDED, KINDS_BY_NAME, EnginePool, engine_params, kind_params
from weightsync.bucketing import plan_buckets
from weightsync.engines.base import DigestReader, verbs_of
from weightsync.integrity import digest
from weightsync.manifest import TensorMeta
from weightsync.push.packer import pack_stream, stream_order

BUCKET_BYTES = 256 << 10
BF16_MAX_GAP = 0.5
BF16_MEAN_GAP = 0.05
"""Teacher-forced logprob gaps between an engine's bf16 kernels and transformers' bf16
eager ones (measured: vLLM's CPU kernels max 0.10, mean 0.02 on the widened model of
tests/integration; here embedded and vLLM alike max 0.016, mean 0.005; against the
weights before the push: 2.2-2.5)."""

pytestmark = pytest.mark.engine_dtype("bfloat16")  # the session starts its bf16 vllm serve early


def fp32_trainer(pool: EnginePool, seed: int) -> torch.nn.Module:
    """fp32 master weights: the bf16 checkpoint loaded in float32, then a training step."""
    trainer = load_trainer(pool.model_dir("bfloat16"))
    assert all(p.dtype == torch.float32 for p in trainer.parameters())
    perturb(trainer, seed)
    return trainer


def served_values(url: str, name: str) -> torch.Tensor:
    """A served tensor read back whole over SGLang's own route (values as float32 lists)."""
    body = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 1 << 20}, timeout=60)
    body.raise_for_status()
    return torch.tensor(body.json(), dtype=torch.float32)


@pytest.mark.parametrize(("engine_kind", "transport"), engine_params())
def test_fp32_trainer_to_bf16_engine_is_bit_exact(engine_kind: str, transport: str, engine_pool: EnginePool,
                                                    disk_root: Path) -> None:
    trainer = fp32_trainer(engine_pool, seed=len(transport))
    engine = engine_pool.clients(engine_kind, dtype="bfloat16")[0]
    with ws.WeightSync(engines=[engine], transport=transport, bucket_bytes=BUCKET_BYTES,
                       disk_root=str(disk_root / "precision")) as sync:
        version = next_version()
        report = sync.push(trainer, version=version)
    assert report.verified and report.acks[0].version == version
    assert "cast from float32 to bfloat16" in " ".join(report.notes)
    params = dict(trainer.named_parameters())
    assert report.num_bytes == sum(p.numel() * 2 for p in params.values()), "bf16 bytes on the wire"
    # every engine acks the digests of trainer_tensor.to(bfloat16), packed as sent
    bf16 = {n: p.detach().to(torch.bfloat16) for n, p in params.items()}
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in bf16.items()], BUCKET_BYTES)
    packed = pack_stream(plan, ((n, bf16[n]) for n in stream_order(plan)))
    assert list(report.acks[0].digests) == [digest(buffer) for _, buffer in packed]
    reader = verbs_of(engine, 30.0)  # weightsync serve: its own client (engines/serve.py)
    if engine.capabilities(30.0).reads_digests and isinstance(reader, DigestReader):
        want = {n: digest(t) for n, t in bf16.items()}
        assert reader.digests() == want, "every served tensor == trainer_tensor.to(bfloat16), bit for bit"
    # and the engine scores its own greedy tokens as transformers does with those bf16 weights
    # (teacher-forced, no token agreement: which token wins a near-tie over bf16 weights depends
    # on the CPU's kernels; one greedy token of 24 flipped on an AMD EPYC, none on an Intel Xeon)
    pushed = ws.probe_logprobs(trainer.to(torch.bfloat16), engine, PROBE_PROMPTS, max_new_tokens=8)
    before = ws.probe_logprobs(load_trainer(engine_pool.model_dir("bfloat16")).to(torch.bfloat16), engine,
                               PROBE_PROMPTS, max_new_tokens=8)
    print(f"\nbf16 {engine_kind} over {transport}: gap to the pushed weights {pushed.max_gap:.2e} "
          f"(mean {pushed.mean_gap:.2e}, agreement {pushed.token_agreement:.2f}), to the previous ones "
          f"{before.max_gap:.2e}")
    assert pushed.max_gap < BF16_MAX_GAP and pushed.mean_gap < BF16_MEAN_GAP, pushed
    assert before.max_gap > 2 * BF16_MAX_GAP, "the probe tells the pushed weights from the old ones"


def test_served_bf16_values_read_back_over_sglangs_route(engine_pool: EnginePool) -> None:
    """SGLang's own `/get_weights_by_name` (embedded engine) returns trainer_tensor.to(bfloat16)."""
    trainer = fp32_trainer(engine_pool, seed=11)
    engine = engine_pool.clients(EMBEDDED.name, dtype="bfloat16")[0]
    with ws.WeightSync(engines=[engine], transport="http") as sync:
        assert sync.push(trainer, version=next_version()).verified
    params = dict(trainer.named_parameters())
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias", "model.norm.weight"):
        expected = params[name].detach().to(torch.bfloat16).to(torch.float32)
        got = served_values(engine.label, name)
        assert torch.equal(got, expected), name
        assert not torch.equal(got, params[name].detach()), "the fp32 values were not served as they are"


@pytest.mark.parametrize("engine_kind", kind_params())
def test_replicas_serving_different_dtypes_are_refused_before_any_byte_moves(
        engine_kind: str, engine_pool: EnginePool, disk_root: Path) -> None:
    engines = [*engine_pool.clients(engine_kind, dtype="bfloat16"), *engine_pool.clients(engine_kind)]
    transport = KINDS_BY_NAME[engine_kind].transports[0]
    before = [served_state(e) for e in engines]
    with ws.WeightSync(engines=engines, transport=transport, disk_root=str(disk_root)) as sync, \
            pytest.raises(ws.CastError, match=r"replicas serve different dtypes \(http://127\.0\.0\.1:\d+ serves "
                                              r"bfloat16, http://127\.0\.0\.1:\d+ serves float32\)"):
        sync.push(fp32_trainer(engine_pool, seed=7), version=next_version())
    assert [served_state(e) for e in engines] == before
    # an explicit dtype overrides; the fp32 replica then refuses bf16 at its dry run
    with ws.WeightSync(engines=engines, transport=transport, disk_root=str(disk_root), dtype="bfloat16") as sync, \
            pytest.raises(ws.ManifestMismatchError, match="bfloat16"):
        sync.push(fp32_trainer(engine_pool, seed=7), version=next_version())
    assert [served_state(e) for e in engines] == before


def test_a_cast_that_overflows_is_refused_and_the_engine_keeps_its_weights(engine_pool: EnginePool) -> None:
    """Embedded engine only (a float16 vLLM would be one more vLLM start)."""
    engine = engine_pool.clients(EMBEDDED.name, dtype="float16")[0]
    trainer = fp32_trainer(engine_pool, seed=8)
    with ws.WeightSync(engines=[engine], transport="http") as sync:
        good = sync.push(trainer, version=next_version())
        assert good.verified
        before = (engine.weight_version(), engine.digests())
        with torch.no_grad():
            trainer.model.layers[1].mlp.down_proj.weight[0, 0] = 1e6  # beyond float16's 65504
        with pytest.raises(ws.CastError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight' from torch\.float32 "
                                               r"to torch\.float16 overflows"):
            sync.push(trainer, version=next_version())
        assert (engine.weight_version(), engine.digests()) == before
        trainer.model.layers[1].mlp.down_proj.weight.data[0, 0] = 1.0
        assert sync.push(trainer, version=next_version()).verified  # the next push goes through


def test_an_explicit_dtype_must_be_floating(engine_pool: EnginePool) -> None:
    with pytest.raises(ValueError, match="must be a floating dtype"):
        ws.WeightSync(engines=engine_pool.clients(EMBEDDED.name, dtype="bfloat16"), transport="http",
                      dtype=torch.int8)
