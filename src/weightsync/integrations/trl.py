"""TRL's `AsyncGRPOTrainer` weight-transfer backend: `weight_transfer=WeightTransfer(engines=...)`.

The boundary: TRL's `WeightTransferProtocol` (trl 1.16.0: `init_weight_transfer`, `pause`,
`send_weights(iterator)`, `resume`, `destroy`) on one side, one `WeightSync` on the other; each
`send_weights` is one verified push of the next version, raising unless every engine acked it.
This module never imports TRL; TRL never imports it. What TRL does around each call, memory,
`name_experts` and `keep_base_exact`: docs/INTEGRATIONS.md ("TRL").
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weightsync.engines.base import Engine
from weightsync.errors import IntegrityError, ManifestMismatchError, WeightSyncError, format_names
from weightsync.manifest import TensorMeta
from weightsync.naming import ExpertLayout, ExpertSlice, checkpoint_slices, expert_stacks, map_names
from weightsync.push.sync import WeightSync
from weightsync.reports import SyncReport
from weightsync.sources import WeightSource, stacked_source
from weightsync.transports.base import Transport

log = logging.getLogger(__name__)

_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")
"""A per-expert tensor's name (for an error's hint only: what is stacked comes from the model)."""


class HeldTensors:
    """A `WeightSource` over named tensors already in hand (TRL's iterator, held), in their order.

    The tensors are references to what the iterator yielded: reading them during a
    push reads the trainer's parameters as they are at that moment. With `experts`
    (`naming.checkpoint_slices` of the model: fused expert tensor name -> its per-expert
    checkpoint tensors, and a tensor the checkpoint names otherwise -> that name), it is
    an `ExpertSource`: an engine that loads experts one by one (vLLM) gets each as a view
    of the fused tensor TRL sent, every tensor under its checkpoint name. With `stacked_as`
    (a model that holds its experts one by one, as TRL's iterator then yields them), an
    engine that loads them fused (`weightsync serve`) gets each layer's fused tensors,
    stacked by the model's conversion mapping (`sources.stacked_source`).
    """

    mode = "full"

    def __init__(self, named: Iterator[tuple[str, torch.Tensor]], *,
                 experts: Mapping[str, Sequence[tuple[str, ExpertSlice | None]]] | None = None,
                 buffers: Mapping[str, torch.Tensor] | None = None, stacked_as: nn.Module | None = None) -> None:
        self._held: dict[str, torch.Tensor] = {}
        for name, tensor in named:
            if name in self._held:
                raise ValueError(f"the weight iterator yielded {name!r} twice; each weight must come once")
            self._held[name] = tensor
        for name, buffer in (buffers or {}).items():  # persistent buffers the iterator (parameters) left out
            self._held.setdefault(name, buffer.detach())
        self._experts = dict(experts or {})
        self._stacked_as = stacked_as
        self._split: dict[str, tuple[str, ExpertSlice | None]] = {}
        """Per-expert checkpoint name -> (the tensor TRL sent, where it lies in it; None: all of
        it), when sent in the checkpoint's layout."""

    def in_layout(self, expert_layout: ExpertLayout) -> WeightSource:
        if expert_layout == "fused":
            return self if self._stacked_as is None else stacked_source(self, conversions_of=self._stacked_as)
        if not self._experts:
            return self
        missing = sorted(n for n in self._experts if n not in self._held)
        if missing:
            raise ValueError(f"TRL did not send the tensor(s) {format_names(missing)} that name_experts read "
                             "from the model (fused experts, or tensors its checkpoint names otherwise): pass the "
                             "model TRL trains")
        split = copy.copy(self)
        split._split = {name: (fused, where) for fused, parts in self._experts.items() for name, where in parts}
        return split

    def metas(self) -> list[TensorMeta]:
        metas = []
        for name, t in self._held.items():
            parts = self._experts.get(name) if self._split else None
            if parts is None:
                metas.append(TensorMeta(hf_name=name, dtype=t.dtype, shape=tuple(t.shape)))
            else:
                metas.extend(TensorMeta(hf_name=n, dtype=t.dtype,
                                        shape=tuple(t.shape) if where is None else where.shape(tuple(t.shape)))
                             for n, where in parts)
        return metas

    def tensors(self, hf_names: Sequence[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name in [m.hf_name for m in self.metas()] if hf_names is None else hf_names:
            split = self._split.get(hf_name)
            try:
                if split is None:
                    yield hf_name, self._held[hf_name]
                else:
                    held, where = split
                    yield hf_name, self._held[held] if where is None else where.of(self._held[held])
            except KeyError:
                raise KeyError(f"{hf_name!r} is not among the {len(self._held)} weights TRL sent") from None


class WeightTransfer:
    """TRL's `WeightTransferProtocol` over a `WeightSync`: each `send_weights` is one verified push.

    `engines`, `transport` and `**options` are `WeightSync`'s (`pause`, `timeout_s`,
    `bucket_bytes`, `disk_root`, ...; `mode` is always "full": TRL sends whole,
    merged weights). The `WeightSync` is made by `init_weight_transfer`, which TRL
    calls on its main process only, so building this object on every rank is free.
    """

    def __init__(self, engines: Sequence[Engine], *, transport: str | Transport = "http",
                 first_version: int = 1, **options: Any) -> None:
        if "mode" in options:
            raise ValueError("TRL sends whole (for PEFT: merged) weights, so the mode is 'full'; "
                             "leave `mode` out")
        if isinstance(first_version, bool) or not isinstance(first_version, int) or first_version < 0:
            raise ValueError(f"first_version must be a non-negative integer, got {first_version!r}")
        self.engines = list(engines)
        self.transport = transport
        self.options = options
        self.sync: WeightSync | None = None
        """Made by `init_weight_transfer`, closed by `destroy`."""
        self.next_version = first_version
        """The version the next `send_weights` pushes."""
        self.reports: list[SyncReport] = []
        """One verified report per `send_weights`, in order."""
        self._experts: dict[str, list[tuple[str, ExpertSlice | None]]] = {}
        """Held tensor name -> its checkpoint tensors where they differ (`name_experts`)."""
        self._buffers: dict[str, torch.Tensor] = {}
        """Checkpoint name -> the model's persistent buffer (`name_experts`), sent where TRL's
        iterator leaves it out."""
        self._stacked_as: nn.Module | None = None
        """The model, when it holds its experts one by one (`name_experts`)."""
        self._exact_model: nn.Module | None = None
        self._saved_base: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        """(parameter, its host copy) for every LoRA layer's base weight, between pause and resume."""

    # -- TRL's protocol ------------------------------------------------------

    def init_weight_transfer(self) -> None:
        """Make the `WeightSync` (its transport and engine checks). Called once, on train begin."""
        if self.sync is None:
            self.sync = WeightSync(self.engines, transport=self.transport, **self.options)

    def pause(self) -> None:
        """Nothing to pause: the push pauses each engine by its policy around the commit.
        With `keep_base_exact`, copy the base weights before TRL merges the adapter into them."""
        if self._exact_model is not None:
            self._save_base(self._exact_model)

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Push what `iterator` yields as the next version; raise unless every engine acked it."""
        if self.sync is None:
            raise WeightSyncError("send_weights before init_weight_transfer: TRL calls init_weight_transfer on "
                                  "train begin; outside TRL, call it first")
        source = HeldTensors(iterator, experts=self._experts, buffers=self._buffers, stacked_as=self._stacked_as)
        version = self.next_version
        try:
            report = self.sync.push(source, version=version)
        except ManifestMismatchError as e:
            fused = [m.hf_name for m in source.metas() if ".experts." in m.hf_name and len(m.shape) == 3]
            if fused and not self._experts:
                e.add_note(f"TRL sends Mixture-of-Experts experts fused ({format_names(fused)}); an engine that "
                           "loads them one per expert (vLLM) needs transfer.name_experts(trainer.model)")
            per_expert = [name for name in e.unexpected if _EXPERT_INDEX.search(name)]
            if per_expert and self._stacked_as is None:
                e.add_note(f"TRL sends the model's experts one by one ({format_names(per_expert)}); an engine "
                           "that loads them fused (weightsync serve) needs transfer.name_experts(trainer.model)")
            if e.missing and not self._buffers:
                e.add_note("TRL's iterator yields parameters only; a persistent buffer the engine loads (a "
                           "router's e_score_correction_bias) is sent after transfer.name_experts(trainer.model)")
            raise
        if not report.verified:  # push raises on every refusal; an unverified report is still no sync
            raise IntegrityError(f"the push of v{version} was not verified by every engine: {report.notes}")
        self.next_version = version + 1
        self.reports.append(report)
        log.info("TRL sync: v%d verified, %d tensors, %d bytes in %.3f s", version, report.num_tensors,
                 report.num_bytes, report.seconds)

    def resume(self) -> None:
        """Nothing to resume (the push did); with `keep_base_exact`, write the base weights back."""
        self._restore_base()

    def destroy(self) -> None:
        """Write back the base weights if a failed sync left them merged-then-unmerged, close the push session."""
        self._restore_base()
        if self.sync is not None:
            self.sync.close()
            self.sync = None

    # -- Mixture-of-Experts ------------------------------------------------------

    def name_experts(self, model: nn.Module) -> None:
        """Read from `model` (TRL's `trainer.model`) which of the tensors TRL sends are fused
        Mixture-of-Experts parameters (transformers 5 holds each layer's experts as two 3-D
        tensors), so each engine gets them in the layout it loads: vLLM one tensor per
        expert and projection, as `save_pretrained` writes them (views, no copy);
        `weightsync serve` fused, as sent. TRL sends them fused, so without this a push into
        vLLM is refused before any byte moves, naming them. Also reads the model's persistent
        buffers (a GLM-4.5 or DeepSeek-V3 router's `e_score_correction_bias`), which TRL's
        iterator of parameters leaves out and the engines load: each push sends them too
        (without them it is refused, naming them, and the engine keeps its router). Where the
        checkpoint names a tensor otherwise than the model holds it (Mixtral's `block_sparse_moe.`
        block, `mlp.` in transformers 5), an engine that loads the checkpoint's names gets those.
        A model that holds its experts one by one (transformers 4's `nn.ModuleList`, a custom
        model) is the reverse: `weightsync serve`, which loads them fused, gets each layer's
        fused tensors stacked from what TRL sends, by the model's conversion mapping."""
        self._experts = checkpoint_slices(model)
        self._buffers = {p.hf_name: p.param for p in map_names(model, expert_layout="fused").params if p.is_buffer}
        self._stacked_as = model if expert_stacks(model) else None
        if not self._experts and not self._buffers and self._stacked_as is None:
            raise ValueError(f"{type(model).__name__} holds no Mixture-of-Experts parameters (fused or one by "
                             "one) and no persistent buffers: nothing to name (dense models need no call)")

    # -- exact base weights under PEFT -------------------------------------------

    def keep_base_exact(self, model: nn.Module) -> None:
        """Keep the base weights of `model` (TRL's PEFT model, `trainer.model`) bit-identical
        across TRL's in-place merge/unmerge. Costs a host copy of every LoRA layer's base
        weights during each sync. One process only: TRL calls the transfer on its main
        process alone, so the other ranks' shards would not be restored."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("keep_base_exact needs a single training process: TRL calls the weight transfer on "
                             f"the main process only, so the other {dist.get_world_size() - 1} ranks' base "
                             "weights would still change")
        if not any(isinstance(m, BaseTunerLayer) for m in model.modules()):
            raise ValueError(f"{type(model).__name__} has no LoRA layer: pass the trainer's PEFT model "
                             "(`trainer.model`) built from a `peft_config`")
        self._exact_model = model

    def _save_base(self, model: nn.Module) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                for param in module.get_base_layer().parameters(recurse=False):
                    saved.append((param, param.detach().to("cpu", copy=True)))
        self._saved_base = saved

    def _restore_base(self) -> None:
        if self._saved_base is None:
            return
        saved, self._saved_base = self._saved_base, None
        with torch.no_grad():
            for param, copy in saved:
                param.copy_(copy)


__all__ = ["HeldTensors", "WeightTransfer"]
