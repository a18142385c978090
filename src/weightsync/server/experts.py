"""Per-expert checkpoint names on SGLang's update routes, written into the served fused experts (`ExpertFuser`).

A trainer pushing to a stock SGLang (or `weightsync serve --sglang-only`) sends a Mixture-of-Experts
layer as per-expert tensors, as a `save_pretrained` checkpoint holds it; this server serves
transformers' fused 3-D experts. Only the SGLang-shaped routes come here (`server/routes_updates.py`,
`server/updates.py`); weightsync's own routes take the fused layout. How an update fills the fused
tensors: docs/MOE.md.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import torch
from torch import nn

from weightsync.bucketing import unpack
from weightsync.errors import ManifestMismatchError, format_names
from weightsync.formats.version_dir import read_version
from weightsync.naming import ExpertSlice, checkpoint_slices
from weightsync.receive.update_session import NamedTensors

REFUSED = "update refused, served weights unchanged"


class ExpertFuser:
    """The per-expert checkpoint names of `model`'s fused expert parameters, and the
    fused tensor and slice each one is written into."""

    def __init__(self, model: nn.Module) -> None:
        self._slices: dict[str, tuple[str, ExpertSlice]] = {}
        """per-expert checkpoint name -> (the served fused hf_name, where it lies in it)."""
        self._renamed: dict[str, str] = {}
        """checkpoint name -> served name, for the other tensors a checkpoint names otherwise
        (transformers' renamings: Mixtral's router `block_sparse_moe.gate.weight` is served as
        `mlp.gate.weight`); empty for most models."""
        for served, parts in checkpoint_slices(model).items():
            for name, where in parts:
                if where is None:
                    self._renamed[name] = served
                else:
                    self._slices[name] = (served, where)

    def names_experts(self, hf_names: Collection[str]) -> bool:
        """Whether any of `hf_names` is one expert of a fused parameter, or a checkpoint name
        this server serves under another (a stock SGLang's push, which `fuse` maps)."""
        return any(name in self._slices or name in self._renamed for name in hf_names)

    def fuse(self, named: NamedTensors, base: Callable[[str], torch.Tensor], *, full: bool) -> NamedTensors:
        """`named` with every per-expert tensor written into a copy of `base(fused_name)`, that
        fused tensor listed once in its place; a tensor the checkpoint names otherwise goes under
        the served name; other names pass through. With `full` (a whole
        checkpoint), every expert of the model must be there. Raises ValueError naming the
        offending tensors (ManifestMismatchError for a wrong shape or dtype, or a missing expert)
        before anything the caller serves is written."""
        fused: dict[str, torch.Tensor] = {}
        passed: list[tuple[str, torch.Tensor]] = []
        seen: set[str] = set()
        for name, tensor in named:
            slot = self._slices.get(name)
            if slot is None:
                passed.append((self._renamed.get(name, name), tensor))
                continue
            if name in seen:
                raise ValueError(f"{REFUSED}: tensor(s) sent twice in one update: {name}")
            seen.add(name)
            fused_name, expert = slot
            if fused_name not in fused:
                fused[fused_name] = base(fused_name).detach().clone()
            view = expert.of(fused[fused_name])
            if tensor.dtype != view.dtype or tuple(tensor.shape) != tuple(view.shape):
                raise ManifestMismatchError(
                    f"{REFUSED}: 1 shape/dtype mismatch(es): {name}: sent {tuple(tensor.shape)} {tensor.dtype}, "
                    f"the served model has {tuple(view.shape)} {view.dtype} (one expert of {fused_name})",
                    mismatched=[name])
            view.copy_(tensor)
        both = [name for name, _ in passed if name in fused]
        if both:
            raise ValueError(f"{REFUSED}: sent both the fused tensor and per-expert tensors of {format_names(both)}")
        missing = [name for name in self._slices if name not in seen] if full else []
        if missing:
            raise ManifestMismatchError(f"{REFUSED}: a whole checkpoint lacks {len(missing)} expert tensor(s): "
                                        f"{format_names(missing)}", missing=missing)
        return [*passed, *fused.items()]


def read_checkpoint_version(directory: Path) -> NamedTensors:
    """Every tensor of a disk version directory (`weightsync.formats.version_dir`), each bucket
    verified against its digest, as named tensors (views of the bucket buffers): the
    version read as the checkpoint its safetensors bucket files are. Dense entries only."""

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        _, buckets = read_version(directory)
        for bucket, buffer in buckets:
            sparse = [e.hf_name for e in bucket.entries if not e.is_dense]
            if sparse:
                raise ValueError(f"{REFUSED}: {directory} holds sparse entries {format_names(sparse)}, which "
                                 "cannot be read as a checkpoint")
            yield from unpack(buffer, bucket)

    return list(tensors())
