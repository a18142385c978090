"""SGLang's `/weights_checker` on the embedded engine: snapshot, reset_tensors, compare and checksum.

slime and miles run it with `--check-weight-update-equal` (docs/ENGINES.md): snapshot the loaded
weights, overwrite them with noise, push, then compare: the push must restore every tensor bit for
bit. `server/routes_control.py` serves it. How its answers differ from SGLang's (names, hash, torn
weights after a reset): docs/ARCHITECTURE.md, "Design notes, by module".
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weightsync.errors import format_names
from weightsync.server.updates import WeightUpdater

ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")
SELECTORS = ("target", "all")
"""SGLang's `selector` values this engine serves (it has no draft model)."""


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's CPU `tensor_hash`, as `weight_checker._hash_tensor` formats it."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()  # type: ignore[arg-type]  # numpy is a buffer


def overall_checksum(checksums: Mapping[str, str]) -> str:
    """SGLang's `overall_checksum`: SHA-256 over the sorted names and their checksums."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


class WeightChecker:
    """The snapshot of one engine, and the four actions on its served weights."""

    def __init__(self, updater: WeightUpdater) -> None:
        self.updater = updater
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._lock = threading.Lock()

    def handle(self, action: str, skip: Sequence[str]) -> dict[str, Any]:
        """Run `action` (one of ACTIONS), leaving out the names that contain a `skip`
        substring; returns the answer's fields. ValueError (400) names a bad action or
        a failed compare; ConflictError (409) an open update session."""
        with self._lock:
            if action == "snapshot":
                self._snapshot = {n: t.clone() for n, t in self._served(skip).items()}
                return {"message": f"snapshot of {len(self._snapshot)} tensor(s)"}
            if action == "reset_tensors":
                names = self.updater.reset_weights(lambda name: not _skipped(name, skip))
                return {"message": f"reset {len(names)} tensor(s)"}
            if action == "compare":
                return {"message": self._compare(skip)}
            if action == "checksum":
                checksums = {n: tensor_checksum(t) for n, t in self._served(skip).items()}
                overall = overall_checksum(checksums)
                rank = {"checksums": checksums, "per_gpu_checksum": overall,
                        "parallelism_info": {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0,
                                             "dp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}}
                return {"message": f"checksum of {len(checksums)} tensor(s)", "ranks": [rank],
                        "per_engine_checksum": hashlib.sha256(overall.encode()).hexdigest()}
            raise ValueError(f"unknown weights_checker action {action!r}; use one of {', '.join(ACTIONS)}")

    def _served(self, skip: Sequence[str]) -> dict[str, torch.Tensor]:
        """The served tensors not skipped (views, read between two steps)."""
        with self.updater.weights.between_steps():
            return {n: p.detach() for n, p in self.updater.weights.params.items() if not _skipped(n, skip)}

    def _compare(self, skip: Sequence[str]) -> str:
        snapshot, self._snapshot = self._snapshot, None  # SGLang consumes it, equal or not
        if snapshot is None:
            raise ValueError("weights_checker 'compare' needs a snapshot: call it with action 'snapshot' first")
        with self.updater.weights.between_steps():
            served = {n: p.detach() for n, p in self.updater.weights.params.items()}
            differ = [n for n, t in snapshot.items() if not _skipped(n, skip) and not _same_bytes(served[n], t)]
        if differ:
            raise ValueError(f"{len(differ)} of {len(snapshot)} tensor(s) differ from the snapshot: "
                             f"{format_names(differ)}")
        return f"all {len(snapshot)} tensor(s) equal the snapshot"


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaNs included, which torch.equal calls unequal)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def _skipped(name: str, skip: Sequence[str]) -> bool:
    return any(pattern in name for pattern in skip)
