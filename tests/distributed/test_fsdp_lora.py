"""LoRA under FSDP2 on 2 gloo ranks: the merged stream equals a single-process
`merge_and_unload()` bit for bit, the trainer's shards are untouched, training
continues with the losses it would have had without the sync, the adapter
stream and export gather only adapter tensors, and LoRA on a sharded parameter
(PEFT target_parameters) is refused by name.

One spawn runs every step (spawning costs seconds); the ranks save what they
saw and the assertions run here, against references computed in one process.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file

from dist_util import init_gloo
from weightsync.lora import CONFIG_NAME, WEIGHTS_NAME, export_lora_adapter
from weightsync.lora.source import LoraSource, MergedLoraSource
from weightsync.tiny import TinyModelConfig, build_model

WORLD_SIZE = 2
TOKENS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 8, 9], [1, 2, 3, 4, 300, 301, 302, 511, 10, 11]])
CFG = TinyModelConfig(num_layers=2)


def _build() -> PeftModel:
    """The same PEFT model on every rank and in the test process: LoRA on every linear, B non-zero."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, use_rslora=True)
    model = get_peft_model(build_model(CFG), config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    optimizer.zero_grad()
    loss = model(input_ids=TOKENS, labels=TOKENS).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())


@contextmanager
def _gathers() -> Iterator[list[int]]:
    """Bytes of every DTensor gathered inside the block, in order."""
    from torch.distributed.tensor import DTensor

    original = DTensor.full_tensor
    log: list[int] = []

    def logged(self: Any, **kwargs: Any) -> torch.Tensor:
        out = original(self, **kwargs)
        log.append(out.numel() * out.element_size())
        return out

    DTensor.full_tensor = logged  # type: ignore[method-assign]
    try:
        yield log
    finally:
        DTensor.full_tensor = original  # type: ignore[method-assign]


def _local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    init_gloo(rank, world_size, init_file)
    mesh = init_device_mesh("cpu", (world_size,))
    synced, control = _build(), _build()  # identical; only `synced` is ever synced
    optimizers = []
    for model in (synced, control):
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizers.append(torch.optim.AdamW(trainable, lr=1e-2))
    assert all(isinstance(p, DTensor) for p in synced.parameters())
    out: dict[str, Any] = {"losses_synced": [], "losses_control": []}

    def train() -> None:
        out["losses_synced"].append(_step(synced, optimizers[0]))
        out["losses_control"].append(_step(control, optimizers[1]))

    train()
    # What the sync reads, gathered whole for the single-process reference.
    out["state"] = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in synced.state_dict().items()}
    out["shards_before"] = _local_shards(synced)

    merged_source = MergedLoraSource(synced)
    out["merged_metas"] = merged_source.metas()
    out["merged"], out["merged_gathers"] = {}, []
    with _gathers() as log:
        for hf_name, tensor in merged_source.tensors():
            out["merged"][hf_name] = tensor
            out["merged_gathers"].append(list(log))
            log.clear()
    lora_source = LoraSource(synced)
    out["lora_metas"] = lora_source.metas()
    with _gathers() as log:
        out["lora"] = dict(lora_source.tensors())
    out["lora_gathers"] = list(log)
    with _gathers() as log:
        export_lora_adapter(synced, Path(out_dir) / "adapter", write=rank == 0)
    out["export_gathers"] = list(log)
    out["shards_after"] = _local_shards(synced)

    # A forward without backward leaves the FSDP2 root unsharded; the stream reads the same.
    with torch.no_grad():
        synced(input_ids=TOKENS)
        control(input_ids=TOKENS)
    # Unsharded tensors come out as the live ones: clone what outlives the next reshard.
    out["merged_after_eval"] = {n: t.clone() for n, t in MergedLoraSource(synced).tensors()}
    for model in (synced, control):
        model.reshard()  # type: ignore[operator]
    out["shards_after_eval"] = _local_shards(synced)

    train()
    train()
    out["final_synced"], out["final_control"] = _local_shards(synced), _local_shards(control)

    # LoRA on a parameter (PEFT target_parameters), sharded: lora-merged refuses it by name.
    on_param = get_peft_model(build_model(CFG), LoraConfig(r=4, target_modules=[],
                                                            target_parameters=["mlp.down_proj.weight"]))
    for layer in on_param.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(on_param, mesh=mesh)
    try:
        MergedLoraSource(on_param)
        out["on_param_refusal"] = None
    except ValueError as e:
        out["on_param_refusal"] = str(e)
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert list(got) == list(want) or set(got) == set(want), (what, set(got) ^ set(want))
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:4]}"


Ranks = tuple[list[dict[str, Any]], Path]
_SPAWNED: list[Ranks | str] = []  # one spawn serves every test of this module (or its failure)


@pytest.fixture
def ranks(run_distributed: Callable[..., None], tmp_path_factory: pytest.TempPathFactory) -> Ranks:
    """What each rank saw, and the directory it wrote to (the adapter export is there)."""
    if not _SPAWNED:
        out_dir = tmp_path_factory.mktemp("fsdp_lora")
        try:
            run_distributed(_worker, WORLD_SIZE, str(out_dir))
        except AssertionError as e:
            _SPAWNED.append(str(e))
            raise
        outs = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]
        _SPAWNED.append((outs, out_dir))
    if isinstance(_SPAWNED[0], str):
        pytest.fail(f"the distributed run failed (see the first test):\n{_SPAWNED[0]}")
    return _SPAWNED[0]


@pytest.fixture
def reference(ranks: Ranks) -> PeftModel:
    """A plain single-process PEFT model holding exactly the trainer's state at sync time."""
    states = [r["state"] for r in ranks[0]]
    _assert_bit_equal(states[1], states[0], "gathered state of rank 1 vs rank 0")
    model = _build()
    model.load_state_dict(states[0], strict=True)
    return model.eval()


def test_merged_stream_equals_single_process_merge_and_unload(
    ranks: Ranks, reference: PeftModel
) -> None:
    want = copy.deepcopy(reference).merge_and_unload().state_dict()
    base = build_model(CFG).state_dict()
    for rank, out in enumerate(ranks[0]):
        _assert_bit_equal(out["merged"], want, f"rank {rank} merged stream")
        _assert_bit_equal(out["merged_after_eval"], want, f"rank {rank} merged stream after an eval forward")
        assert [m.hf_name for m in out["merged_metas"]] == list(out["merged"])
    assert not torch.equal(want["model.layers.1.mlp.down_proj.weight"], base["model.layers.1.mlp.down_proj.weight"])


def test_merged_stream_gathers_one_weight_and_its_adapter_at_a_time(
    ranks: Ranks, reference: PeftModel
) -> None:
    lora_names = {f"{n.removesuffix('.base_layer.weight')}" for n, _ in reference.named_parameters()
                  if n.endswith(".base_layer.weight")}
    for out in ranks[0]:
        for meta, gathered in zip(out["merged_metas"], out["merged_gathers"], strict=True):
            is_lora = f"base_model.model.{meta.hf_name.removesuffix('.weight')}" in lora_names
            assert len(gathered) == (3 if is_lora else 1), (meta.hf_name, gathered)
            assert gathered[0] == meta.nbytes


def test_shards_are_bit_identical_after_the_sync(ranks: Ranks) -> None:
    for rank, out in enumerate(ranks[0]):
        _assert_bit_equal(out["shards_after"], out["shards_before"], f"rank {rank} shards after sync")
        _assert_bit_equal(out["shards_after_eval"], out["shards_before"], f"rank {rank} shards after eval sync")


def test_training_continues_as_without_the_sync(ranks: Ranks) -> None:
    for rank, out in enumerate(ranks[0]):
        assert len(out["losses_synced"]) == 3
        assert out["losses_synced"] == out["losses_control"], rank
        assert out["losses_synced"][2] < out["losses_synced"][0]  # it is training
        _assert_bit_equal(out["final_synced"], out["final_control"], f"rank {rank} shards after training")


def test_lora_stream_gathers_only_adapter_tensors(
    ranks: Ranks, reference: PeftModel
) -> None:
    want = get_peft_model_state_dict(reference)
    adapter_bytes = sorted(t.numel() * t.element_size() for t in want.values())
    for rank, out in enumerate(ranks[0]):
        assert [m.hf_name for m in out["lora_metas"]] == list(want)
        _assert_bit_equal(out["lora"], want, f"rank {rank} lora stream")
        assert sorted(out["lora_gathers"]) == adapter_bytes
        assert sorted(out["export_gathers"]) == adapter_bytes


def test_export_matches_the_single_process_export_and_loads(
    ranks: Ranks, reference: PeftModel, tmp_path: Path
) -> None:
    sharded = ranks[1] / "adapter"
    single = export_lora_adapter(reference, tmp_path / "single")
    got, want = load_file(sharded / WEIGHTS_NAME), load_file(single / WEIGHTS_NAME)
    _assert_bit_equal(got, want, "exported tensors")
    assert json.loads((sharded / CONFIG_NAME).read_text()) == json.loads((single / CONFIG_NAME).read_text())

    loaded = PeftModel.from_pretrained(build_model(CFG), sharded).eval()
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, reference(TOKENS).logits)


def test_lora_on_a_sharded_parameter_is_refused_by_name(ranks: Ranks) -> None:
    """PEFT target_parameters (a ParamWrapper) under FSDP2: lora-merged merges such LoRA only
    unsharded, and says so naming the module, the parameter and what to push instead."""
    for out in ranks[0]:
        assert out["on_param_refusal"] is not None
        assert "model.layers.0.mlp.down_proj' (ParamWrapper): LoRA on the parameter 'weight'" in out["on_param_refusal"]
        assert "is sharded (FSDP2)" in out["on_param_refusal"] and "mode='full'" in out["on_param_refusal"]
