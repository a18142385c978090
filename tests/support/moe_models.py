"""Tiny Mixture-of-Experts models and trainer edits shared by the MoE tests (built from
configs: `weightsync.tiny`, archs "qwen3_moe", "mixtral", "glm4_moe" and "deepseek_v3")."""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from weightsync.manifest import TensorMeta
from weightsync.server.launch import ServerProcess, launch_server
from weightsync.sources import ModuleSource
from weightsync.tiny import TinyModelConfig, make_tiny_model


def make_moe_dir(root: Path, arch: str, dtype: str = "float32") -> Path:
    """A tiny `arch` model directory: 2 layers, 8 experts of width 64 (glm4_moe: layer 0
    dense, layer 1 MoE with a shared expert and the router bias buffer)."""
    return make_tiny_model(root / f"{arch}-{dtype}", TinyModelConfig(arch=arch, dtype=dtype))


def moe_vllm(arch: str, dtype: str = "float32", *args: str) -> Any:
    """A test module's `vllm serve` (`vllm_shared_server.ModuleVLLM`) of the tiny `arch` model
    in `dtype`: 512-token sequences, eager, seeded; `args` added."""
    from vllm_shared_server import ModuleVLLM

    name = arch.replace("_", "-") + ("" if dtype == "float32" else f"-{dtype}")
    return ModuleVLLM(name, make_model=lambda root: make_moe_dir(root, arch, dtype),
                      args=("--dtype", dtype, "--max-model-len", "512", "--enforce-eager", "--seed", "0", *args))


def pushed_into_vllm(engine: Any, trainer: Any, *, num_tensors: int, transport: str = "shm") -> Any:
    """The report of one push of `trainer` into the vLLM `engine` at its next version, checked
    verified (every digest and name acked) and of `num_tensors` checkpoint tensors."""
    import vllm_fixtures as vf
    import weightsync as ws

    with ws.WeightSync([engine], transport=transport) as sync:
        report = sync.push(trainer, version=(version := vf.next_version(engine)))
    vf.assert_verified(report, version)
    assert report.num_tensors == num_tensors, report.num_tensors
    return report


@contextmanager
def moe_serve(root: Path, arch: str, dtype: str = "float32") -> Iterator[tuple[Path, ServerProcess]]:
    """A tiny `arch` model written under `root` and a `weightsync serve` of it (one torch
    thread), stopped on leaving: (model directory, server)."""
    model_dir = make_moe_dir(root, arch, dtype)
    server = launch_server(model_dir, args=["--num-threads", "1"])
    try:
        yield model_dir, server
    finally:
        server.close()


def next_version(engine: Any) -> int:
    """One more than the version a `weightsync serve` (through `SGLangEngine`) serves now."""
    return int(engine.weight_version()) + 1


def engine_and_trainer(model_dir: Path, server: Any, *, seed: int, dtype: torch.dtype = torch.float32
                       ) -> tuple[Any, torch.nn.Module]:
    """An `SGLangEngine` client of `server` (a `weightsync serve`) and a trainer loaded from
    `model_dir` in `dtype` (float32: master weights), every weight moved by seeded noise."""
    import weightsync as ws
    from vllm_fixtures import load_trainer, perturb

    trainer = load_trainer(model_dir).to(dtype)
    perturb(trainer, seed=seed)
    return ws.SGLangEngine(server.url), trainer


def experts(model: torch.nn.Module, layer: int) -> Any:
    """The fused experts module of `layer` (transformers 5: gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    return model.get_submodule(f"model.layers.{layer}.mlp.experts")


def edit_two_experts(model: torch.nn.Module, layer: int = 1, chosen: tuple[int, int] = (2, 5)) -> list[str]:
    """Change experts `chosen` of `layer` (every projection) and nothing else; returns the
    per-expert checkpoint names that changed."""
    module = experts(model, layer)
    gen = torch.Generator().manual_seed(sum(chosen))
    with torch.no_grad():
        for e in chosen:
            module.gate_up_proj[e].add_(torch.randn(module.gate_up_proj[e].shape, generator=gen) * 0.05)
            module.down_proj[e].add_(torch.randn(module.down_proj[e].shape, generator=gen) * 0.05)
    return [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in chosen
            for proj in ("gate_proj", "up_proj", "down_proj")]


def as_the_engine_holds(trainer: torch.nn.Module, kept: Collection[str]) -> torch.nn.Module:
    """A bfloat16 copy of `trainer` whose `kept` tensors stay float32, exactly as the engine
    holds them (the reference transformers scores the engine's tokens with)."""
    reference = copy.deepcopy(trainer).to(torch.bfloat16)
    masters = dict(trainer.state_dict())
    with torch.no_grad():
        for name in kept:
            module_name, _, leaf = name.rpartition(".")
            module = reference.get_submodule(module_name)
            if leaf in module._parameters:
                module._parameters[leaf] = torch.nn.Parameter(masters[name].detach().clone(), requires_grad=False)
            else:
                module._buffers[leaf] = masters[name].detach().clone()
    return reference


class WithoutTensors:
    """A trainer's source with some checkpoint tensors left out (a trainer that lost an expert)."""

    mode = "full"

    def __init__(self, model: torch.nn.Module, left_out: Sequence[str]) -> None:
        self.inner = ModuleSource(model)
        self.left_out = set(left_out)

    def metas(self) -> list[TensorMeta]:
        return [m for m in self.inner.metas() if m.hf_name not in self.left_out]

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        return self.inner.tensors([m.hf_name for m in self.metas()] if hf_names is None else hf_names)


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""An expert's gate, up and down projections as Qwen-MoE / GLM / DeepSeek checkpoints name them."""
MIXTRAL_PROJECTIONS = ("w1", "w3", "w2")
"""The same three as Mixtral's checkpoints name them (gate w1, up w3, down w2)."""


class ExpertMLP(torch.nn.Module):
    """One expert as older transformers (4.x) and checkpoints hold it: gate, up and down
    projections, named `projections`."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 projections: tuple[str, str, str] = PROJECTIONS) -> None:
        super().__init__()
        for name, weight in zip(projections, (gate, up, down), strict=True):
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
            with torch.no_grad():
                linear.weight.copy_(weight)
            setattr(self, name, linear)


def per_expert_trainer(fused: torch.nn.Module, projections: tuple[str, str, str] = PROJECTIONS) -> torch.nn.Module:
    """A copy of transformers-5 MoE model `fused` whose every layer holds its experts one by one
    (the transformers 4 layout: `mlp.experts` an `nn.ModuleList` of `ExpertMLP`s, projections
    named `projections`) with the same weights, in their own storage: what a per-expert trainer
    pushes. It is for pushing, not for running (the MoE block's forward expects the fused module)."""
    model = copy.deepcopy(fused)
    for layer in model.model.layers:
        held = getattr(layer.mlp, "experts", None)
        if held is None or not hasattr(held, "gate_up_proj"):
            continue
        gate_up, down = held.gate_up_proj.detach(), held.down_proj.detach()
        gate, up = gate_up.chunk(2, dim=1)
        layer.mlp.experts = torch.nn.ModuleList(
            ExpertMLP(gate[e], up[e], down[e], projections) for e in range(gate_up.shape[0]))
    return model


def fused_state(per_expert: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the fused (transformers 5) model holding `per_expert`'s weights, stacked
    with torch.stack / torch.cat here (independently of weightsync's packing)."""
    state = dict(per_expert.state_dict())
    for i in range(len(per_expert.model.layers)):
        prefix = f"model.layers.{i}.mlp.experts."
        count = len({n[len(prefix):].split(".")[0] for n in state if n.startswith(prefix)})
        if not count:
            continue
        parts = {proj: [state.pop(f"{prefix}{e}.{proj}.weight") for e in range(count)]
                 for proj in ("gate_proj", "up_proj", "down_proj")}
        state[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(parts["gate_proj"], parts["up_proj"], strict=True)])
        state[prefix + "down_proj"] = torch.stack(parts["down_proj"])
    return state


class CheckpointTensors:
    """A plain stream of checkpoint tensors in hand (a Megatron-style export): per-expert names."""

    mode = "full"

    def __init__(self, named: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.held = dict(named)

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(hf_name=n, dtype=t.dtype, shape=tuple(t.shape)) for n, t in self.held.items()]

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name in list(self.held) if hf_names is None else hf_names:
            yield hf_name, self.held[hf_name]
