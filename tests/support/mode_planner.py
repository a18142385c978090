"""A `weightsync.modes.Planner` for driving one push mode by hand (tests/unit/modes):
the coordinator's answers for one trainer rank, computed in-process from the engine
capabilities a test declares."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import torch

from weightsync import EngineCapabilities, TensorMeta, WeightSource
from weightsync.dtypes import Cast
from weightsync.integrity import digest
from weightsync.reports import Stages
from weightsync.trainer_ranks import TrainerRanks


class ModePlanner:
    """One trainer rank, engines with `capabilities`, floating tensors cast to `cast_to`
    (`cast`: as a mode that casts sees it); `served` (one hf_name -> digest dict per engine
    that reports digests) is what `served_digests` answers."""

    def __init__(self, capabilities: Sequence[EngineCapabilities] = (EngineCapabilities(),), *,
                 cast_to: torch.dtype | None = None, served: Sequence[dict[str, str]] = (),
                 instances: Sequence[str | None] = (), unloaders: Sequence[Any] = ()) -> None:
        self.pool: Executor = ThreadPoolExecutor(max_workers=1)
        self.timeout_s = 10.0
        self.allow_overflow = False
        self.digest_algorithm = "xxh3_64"
        self.stages = Stages()
        self.ranks = TrainerRanks(None)
        self.capabilities: Sequence[EngineCapabilities] = list(capabilities)
        self.cast_to = cast_to
        self.cast = Cast(to=cast_to)
        self.served = list(served)
        self.instances = list(instances)
        self._unloaders = list(unloaders)

    def share_step(self, step: Mapping[str, Any]) -> None:
        raise AssertionError(f"one trainer rank: no other rank to share {dict(step)} with")

    def metas(self, source: WeightSource) -> list[TensorMeta]:
        return list(source.metas())

    def hash_tensors(self, source: WeightSource, *, cast: bool) -> dict[str, str]:
        cast_to = self.cast_to if cast else None
        return {hf_name: digest(as_engine_holds(tensor, cast_to)) for hf_name, tensor in source.tensors()}

    def served_digests(self, hf_names: Sequence[str]) -> list[dict[str, str]]:
        return [{n: d[n] for n in hf_names if n in d} for d in self.served]

    def served_instances(self) -> list[str | None]:
        return self.instances

    def unloaders(self) -> Sequence[Any]:
        return self._unloaders


def as_engine_holds(tensor: torch.Tensor, cast_to: torch.dtype | None) -> torch.Tensor:
    """`tensor` as an engine of dtype `cast_to` holds it (floating tensors cast)."""
    tensor = tensor.detach()
    if cast_to is not None and tensor.is_floating_point():
        tensor = tensor.to(cast_to)
    return tensor.contiguous()
