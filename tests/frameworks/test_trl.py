"""TRL's own `AsyncGRPOTrainer.train()` with `weight_transfer=WeightTransfer(...)`, on CPU.

What runs is TRL 1.16.0's trainer, loss, packing, tree attention, collator, staleness
filter and sync loop (`_sync_weight_merged`: pause, merge_adapter, send_weights,
unmerge_adapter, resume). Not TRL's: the FlashAttention-3 kernel under its tree
attention and its MFU device query (both CUDA only; `trl_on_cpu`).

Into a real bfloat16 `weightsync serve` (a float32 trainer, as TRL trains by default), with
`trl_fixtures.EngineRolloutWorker`, which tags every rollout with the version the engine
reports it generated with: TRL's own worker posts vLLM's `/v1/completions`, which
`weightsync serve` does not serve. And into the session's float32 `vllm serve` with TRL's
own `AsyncRolloutWorker` (`test_trls_own_rollout_worker_on_vllm_serve`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo import async_grpo_trainer as trl_trainer
from trl.experimental.async_grpo import packing as trl_packing
from trl_fixtures import CPU_FLASH_ATTN, VOCAB, EngineRolloutWorker, low_token_reward, low_token_rewards

import weightsync as ws
from serve_check import checked
from weightsync.integrations.trl import WeightTransfer
from weightsync.integrity import digest
from weightsync.server.launch import ServerProcess, launch_server
from weightsync.tiny import TinyModelConfig, make_tiny_model
from weightsync_tools.faults.inject import faulty

STEPS = 12
PROMPTS = [[5, 17, 42, 99], [3, 8, 120, 7], [64, 2, 33, 250], [11, 300, 4, 90]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bfloat16 checkpoint: the engine serves bf16, TRL loads it as float32 (its default dtype)."""
    return make_tiny_model(tmp_path_factory.mktemp("trl-tiny"), TinyModelConfig(dtype="bfloat16", vocab_size=VOCAB))


@pytest.fixture(scope="module")
def server(model_dir: Path, one_torch_thread: None) -> Iterator[ServerProcess]:
    """The engine, with TRL's training on one torch thread beside it (two threads on a 2-core
    machine, where the engine generates at the same time, made each step's backward 0.5-1 s)."""
    yield from checked(launch_server(model_dir, args=["--num-threads", "1"]))


@pytest.fixture(autouse=True)
def trl_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's two CUDA-only calls: the FA3 kernel (a torch stand-in) and the device-name query behind its
    MFU metric (None: what TRL answers for a device it does not know, MFU metrics off)."""
    monkeypatch.setattr(trl_packing, "_flash_attn", lambda: CPU_FLASH_ATTN)
    monkeypatch.setattr(trl_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: None)


class StepEnds(TrainerCallback):
    """At each step's end: the groups TRL's collator has taken so far, and the digests of the
    trainer's weights cast to bf16 (what the sync after that step sends)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.collated: dict[int, int] = {}
        self.served: dict[int, dict[str, str]] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.collated[state.global_step] = len(self.trainer._trained_groups)
        self.served[state.global_step] = served_digests(self.trainer.model)


def served_digests(model: torch.nn.Module) -> dict[str, str]:
    """What the engine must serve after a sync of `model`: every weight under its checkpoint name,
    LoRA merged (PEFT's own delta, added as `merge_adapter` adds it), cast to bfloat16."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            [adapter] = module.active_adapters
            deltas[f"{name}.base_layer.weight"] = module.get_delta_weight(adapter)
    out = {}
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        weight = param.detach() + deltas[name] if name in deltas else param.detach()
        hf_name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        out[hf_name] = digest(weight.to(torch.bfloat16).contiguous())
    return out


def make_trainer(model_dir: Path, tmp_path: Path, server: ServerProcess, transfer: WeightTransfer, *,
                 max_steps: int, learning_rate: float = 0.02, num_generations: int = 4, prompts_per_batch: int = 2,
                 peft_config: Any = None) -> tuple[Any, EngineRolloutWorker, StepEnds]:
    """TRL's trainer on `model_dir` with `transfer`, training on the rollouts of an `EngineRolloutWorker`:
    `prompts_per_batch` prompts x `num_generations` completions of 8 tokens, one batch per step."""
    worker = EngineRolloutWorker(server.url, PROMPTS, low_token_reward, num_generations=num_generations,
                                 prompts_per_batch=prompts_per_batch, max_new_tokens=8)
    steps = StepEnds()
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=max_steps, learning_rate=learning_rate,
        per_device_train_batch_size=num_generations * prompts_per_batch, num_generations=num_generations,
        max_completion_length=8, token_budget=0, max_staleness=1, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=1, seed=0, vllm_server_base_url=server.url)
    trainer = AsyncGRPOTrainer(
        model=str(model_dir), reward_funcs=[], args=args,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]] * 4}),
        callbacks=[steps], peft_config=peft_config, rollout_worker=worker, weight_transfer=transfer)
    steps.trainer = trainer
    return trainer, worker, steps


def test_async_grpo_trains_on_verified_syncs(model_dir: Path, tmp_path: Path, server: ServerProcess) -> None:
    engine = ws.SGLangEngine(server.url)
    first = int(engine.weight_version()) + 1
    transfer = WeightTransfer(engines=[engine], transport="http", first_version=first)
    trainer, worker, steps = make_trainer(model_dir, tmp_path, server, transfer, max_steps=STEPS,
                                          num_generations=8, prompts_per_batch=4)
    trainer.train()

    # a cold sync and one per step, each a verified push of the next version, which is TRL's model_version
    assert [r.version for r in transfer.reports] == list(range(first, first + STEPS + 1))
    assert all(r.verified and r.acks[0].version == r.version for r in transfer.reports)
    assert trainer.model_version == STEPS + 1
    assert engine.weight_version() == str(first + STEPS)
    assert engine.digests() == served_digests(trainer.model), "the engine serves the trained weights, bit for bit"
    # every rollout batch was generated by the weights of the sync just before it, and nothing else
    assert [b.engine_versions for b in worker.batches] == [{first + b.trl_version - 1} for b in worker.batches]
    # step k trains batch k (one micro-batch of 8 per step, the queue is FIFO); accelerate's dispatcher
    # collates batch k+1 before step k trains, i.e. before the sync after step k: so step k trains on
    # rollouts of version k-1 (step 1: version 1). That lag is TRL's loop, whatever the transfer.
    assert steps.collated == {k: (k + 1) * 4 for k in range(1, STEPS + 1)}
    assert [b.trl_version for b in worker.batches[:STEPS]] == [1, *range(1, STEPS)]
    # the reward moves: the two batches of version 1 vs those of versions STEPS-1 and STEPS, which
    # steps STEPS-1 and STEPS took (measured here: 0.51 -> 0.82 of completion tokens in the lower
    # half of the vocabulary)
    def mean_reward(versions: set[int]) -> float:
        rewards = [r for b in worker.batches if b.trl_version in versions for r in b.rewards]
        assert len(rewards) == 2 * 32, versions
        return sum(rewards) / len(rewards)

    # the bound is 0.1, a third of the rise measured here: the rollouts are sampled from bf16 weights,
    # whose kernels differ between CPUs, so the trajectory (not the fact that it learns) varies
    assert mean_reward({STEPS - 1, STEPS}) > mean_reward({1}) + 0.1


def test_refused_push_stops_training_and_engine_keeps_last_good(model_dir: Path, tmp_path: Path,
                                                                 server: ServerProcess) -> None:
    engine = ws.SGLangEngine(server.url)
    first = int(engine.weight_version()) + 1
    # sync 3 (after step 2) has a byte flipped after it was hashed: the engine refuses that bucket
    transport = faulty("http", "flip", timeout_s=30.0, at_push=3, at_bucket=0)
    transfer = WeightTransfer(engines=[engine], transport=transport, first_version=first)
    trainer, _, steps = make_trainer(model_dir, tmp_path, server, transfer, max_steps=4)
    with pytest.raises(ws.WeightSyncError, match="digest"):
        trainer.train()
    assert transport.fired.is_set()
    assert trainer.state.global_step == 2, "TRL stopped at the sync that failed"
    assert [r.version for r in transfer.reports] == [first, first + 1]
    assert trainer.model_version == 2, "TRL never counted the failed sync"
    assert engine.weight_version() == str(first + 1)
    assert engine.digests() == steps.served[1], "the engine serves the last verified weights (after step 1)"
    answer = engine._http.post("/generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
    assert answer["meta_info"]["weight_versions"][0]["weightsync_version"] == first + 1


def test_peft_base_weights_stay_exact(model_dir: Path, tmp_path: Path, server: ServerProcess) -> None:
    from peft import LoraConfig

    engine = ws.SGLangEngine(server.url)
    first = int(engine.weight_version()) + 1
    transfer = WeightTransfer(engines=[engine], transport="http", first_version=first)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"])
    trainer, _, _ = make_trainer(model_dir, tmp_path, server, transfer, max_steps=3, peft_config=lora)
    transfer.keep_base_exact(trainer.model)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "base_layer" in n}
    trainer.train()

    assert [r.version for r in transfer.reports] == list(range(first, first + 4))
    assert all(r.verified for r in transfer.reports)
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert all(bool(p.abs().max() > 0) for p in lora_b), "the adapter trained, so every merge moved the base"
    now = dict(trainer.model.named_parameters())
    assert all(torch.equal(now[n], w) for n, w in base.items()), "TRL's merge/unmerge left no trace"
    # the engine serves base + PEFT's delta, cast to bf16: what merge_adapter sent
    assert engine.digests() == served_digests(trainer.model)
    assert "lm_head.weight" in engine.digests() and not any("lora" in n for n in engine.digests())


@pytest.mark.vllm
def test_trls_own_rollout_worker_on_vllm_serve(vllm_server: Any, vllm_model_dir: Path, tmp_path: Path,
                                               one_torch_thread: None) -> None:
    """TRL's `AsyncRolloutWorker` (a spawned child posting `/v1/completions`) samples from the
    session's float32 `vllm serve` while `WeightTransfer` pushes into it over shared memory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    engine = ws.VLLMEngine(vllm_server.url, timeout_s=120)
    first = int(engine.info()["version"]) + 1
    transfer = WeightTransfer(engines=[engine], transport="shm", first_version=first)
    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    tokenizer.chat_template = qwen2_5_chat_template  # TRL's worker needs a chat template it knows (tool parsing)
    prompts = [[{"role": "system", "content": "go"}, {"role": "user", "content": text}]
               for text in ("the quick brown fox", "one two three", "hello world", "red green")]
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=2, learning_rate=0.02, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=8, token_budget=0, max_staleness=1, queue_maxsize=16,
        use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0,
        vllm_server_base_url=vllm_server.url)
    trainer = AsyncGRPOTrainer(model=str(vllm_model_dir), reward_funcs=[low_token_rewards], args=args,
                               train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                               weight_transfer=transfer)
    trainer.train()

    assert [r.version for r in transfer.reports] == [first, first + 1, first + 2]
    assert all(r.verified and r.acks[0].version == r.version for r in transfer.reports)
    assert engine.info()["version"] == first + 2 and trainer.model_version == 3
    # vLLM serves the trained weights: its greedy tokens, scored by transformers on them (float32 both sides)
    trained = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    trained.load_state_dict(trainer.model.state_dict())
    probe_prompts = [tokenizer.encode(text) for text in ("the quick brown fox", "numbers: 1 2 3")]
    served = ws.probe_logprobs(trained, engine, probe_prompts)
    untrained = ws.probe_logprobs(AutoModelForCausalLM.from_pretrained(vllm_model_dir), engine, probe_prompts)
    assert served.max_gap < 1e-3 < untrained.max_gap, (served, untrained)
