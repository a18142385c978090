"""The demo's RL loop: rollouts from a live engine, a policy-gradient step on
the trainer, a verified weight push every step.

    engine (weightsync serve | vLLM)  --rollouts-->  trainer (PEFT LoRA or full)
                 ^                                         |
                 +------ WeightSync.push(version) ---------+

The trainer scores the engine's sampled tokens before updating, which gives
the logprob gap between engine and trainer for the same weights at every step.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from weightsync.tiny import TinyModelConfig, make_tiny_model
from weightsync_tools.demo.grpo import group_advantages, policy_loss, target_reward, token_logprobs


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What the demo runs."""

    steps: int = 30
    """RL steps (one weight push each)."""
    mode: str = "lora"
    """"full", "lora" or "lora-merged"."""
    transport: str = "http"
    """"http", "shm", "broadcast" or "disk"."""
    engine: str = "embedded"
    """"embedded" (weightsync serve) or "vllm"."""
    engine_dtype: str = "float32"
    """The dtype the engine serves ("bfloat16": the trainer keeps float32 master weights and
    every push casts them in the stream)."""
    prompts_per_step: int = 4
    """Distinct prompts per step."""
    group_size: int = 8
    """Rollouts per prompt (GRPO group)."""
    prompt_len: int = 6
    """Tokens per prompt."""
    max_new_tokens: int = 12
    """Tokens generated per rollout."""
    num_targets: int = 24
    """Size of the target token set the reward counts."""
    learning_rate: float = 5e-3
    """Adam learning rate (LoRA); full fine-tuning uses 0.4 of it."""
    lora_rank: int = 8
    """LoRA rank (all linear layers)."""
    seed: int = 0
    """Seeds prompts, targets, rollouts and initialisation."""
    out_dir: Path = Path("runs/demo")
    """Where the model, the versions (disk), the plot and the report go."""
    model: TinyModelConfig = field(default_factory=lambda: TinyModelConfig(num_layers=2))
    """The tiny model trained."""


@dataclass(frozen=True, kw_only=True)
class StepRow:
    """One step of the demo."""

    step: int
    version: int
    reward: float
    sync_seconds: float
    sync_bytes: int
    gbps: float
    verified: bool
    logprob_gap: float
    engine_versions: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class DemoResult:
    config: dict[str, Any]
    rows: list[StepRow]
    seconds: float
    engine_url: str

    @property
    def reward_start(self) -> float:
        return sum(r.reward for r in self.rows[:5]) / max(1, len(self.rows[:5]))

    @property
    def reward_end(self) -> float:
        return sum(r.reward for r in self.rows[-5:]) / max(1, len(self.rows[-5:]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config, "seconds": round(self.seconds, 3), "engine_url": self.engine_url,
            "reward_start": self.reward_start, "reward_end": self.reward_end,
            "all_verified": all(r.verified for r in self.rows),
            "max_logprob_gap": max((r.logprob_gap for r in self.rows), default=0.0),
            "steps": [asdict(r) for r in self.rows],
        }


@contextlib.contextmanager
def start_engine(cfg: DemoConfig, model_dir: Path) -> Iterator[Any]:
    """The engine and its client; the server process ends with the block, even on Ctrl-C.

    `model_dir` holds the model in the engine's dtype (`cfg.engine_dtype`)."""
    if cfg.engine == "embedded":
        from weightsync.engines.sglang import SGLangEngine
        from weightsync.server.launch import launch_server

        args = ["--enable-lora", "--max-loaded-loras", "4", "--disk-root", str(cfg.out_dir.resolve()),
                "--max-running", str(cfg.prompts_per_step * cfg.group_size), "--num-threads", "1"]
        with launch_server(model_dir, args=args) as server, contextlib.closing(SGLangEngine(server.url)) as client:
            yield client
    elif cfg.engine == "vllm":
        from weightsync.engines.vllm.client import VLLMEngine
        from weightsync.engines.vllm.launch import launch_vllm_server

        args = ["--dtype", cfg.engine_dtype, "--max-model-len", "256"]
        if cfg.mode == "lora":
            args += ["--enable-lora", "--max-lora-rank", str(cfg.lora_rank), "--max-loras", "4"]
        with launch_vllm_server(model_dir, args=args) as vllm, contextlib.closing(VLLMEngine(vllm.url)) as engine:
            yield engine
    else:
        raise ValueError(f"unknown engine {cfg.engine!r}; use 'embedded' or 'vllm'")


def build_trainer(cfg: DemoConfig, model_dir: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lr = cfg.learning_rate
    if cfg.mode in ("lora", "lora-merged"):
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        if cfg.engine == "embedded":
            targets.append("lm_head")  # learns the toy task fast; vLLM takes no LoRA on lm_head
        model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank,
                                                 target_modules=targets, lora_dropout=0.0))
    else:
        lr = lr * 0.4
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.Adam(params, lr=lr)


@contextlib.contextmanager
def trainer_threads_beside(cfg: DemoConfig) -> Iterator[None]:
    """The trainer's torch threads while the loop runs: with the embedded engine on this host
    (one torch thread of its own), the cores it leaves, so the two never share a core. torch's
    default gives the trainer every core; on 2 cores each backward then waited for an OpenMP
    thread the engine had descheduled, and the 30-step demo took 3-4x longer."""
    before = torch.get_num_threads()
    if cfg.engine == "embedded":
        torch.set_num_threads(max(1, min(before, len(os.sched_getaffinity(0)) - 1)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_demo(cfg: DemoConfig, *, on_step: Callable[[StepRow], None] | None = None) -> DemoResult:
    """Run the loop; `on_step` sees each row as it completes (a progress bar)."""
    with trainer_threads_beside(cfg):
        return _run_demo(cfg, on_step)


def _run_demo(cfg: DemoConfig, on_step: Callable[[StepRow], None] | None) -> DemoResult:
    from transformers.utils import logging as hf_logging

    import weightsync as ws

    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = cfg.out_dir / "model"  # the trainer's float32 weights
    if not (model_dir / "config.json").exists():
        make_tiny_model(model_dir, replace(cfg.model, dtype="float32"))
    engine_dir = model_dir if cfg.engine_dtype == "float32" else cfg.out_dir / f"model-{cfg.engine_dtype}"
    if not (engine_dir / "config.json").exists():
        make_tiny_model(engine_dir, replace(cfg.model, dtype=cfg.engine_dtype))  # the same weights, cast
    rng = random.Random(cfg.seed)
    vocab = cfg.model.vocab_size
    targets = frozenset(rng.sample(range(2, vocab), cfg.num_targets))
    prompt_pool = [[rng.randrange(2, vocab) for _ in range(cfg.prompt_len)] for _ in range(64)]
    model, optimizer = build_trainer(cfg, model_dir)
    rows: list[StepRow] = []
    with start_engine(cfg, engine_dir) as engine, ws.WeightSync(
        [engine], transport=cfg.transport, mode=cfg.mode, bucket_bytes=4 << 20,
        pause="retract", timeout_s=60, disk_root=str(cfg.out_dir / "versions"),
    ) as sync:
        sync.push(model, version=1)
        for step in range(1, cfg.steps + 1):
            prompts = [p for p in rng.sample(prompt_pool, cfg.prompts_per_step) for _ in range(cfg.group_size)]
            rollouts = engine.generate(prompts, max_new_tokens=cfg.max_new_tokens, temperature=1.0,
                                       lora_name=sync.lora_name, seed=cfg.seed * 100_000 + step * 1000)
            outputs = [r.output_ids for r in rollouts]
            rewards = torch.tensor([target_reward(o, targets) for o in outputs])
            model.train()
            logprobs = token_logprobs(model, prompts, outputs)
            engine_logprobs = torch.tensor([r.logprobs for r in rollouts])
            gap = float((logprobs.detach() - engine_logprobs).abs().max())
            loss = policy_loss(logprobs, group_advantages(rewards, cfg.group_size))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            report = sync.push(model, version=step + 1)
            row = StepRow(
                step=step, version=report.version, reward=float(rewards.mean()), sync_seconds=report.seconds,
                sync_bytes=report.num_bytes, gbps=report.gbps, verified=report.verified, logprob_gap=gap,
                engine_versions=tuple(sorted({r.weight_version for r in rollouts})),
            )
            rows.append(row)
            if on_step is not None:
                on_step(row)
        engine_url = str(getattr(engine, "url", engine.label))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    return DemoResult(config=config, rows=rows, seconds=time.perf_counter() - started, engine_url=engine_url)
