"""The last weightsync commit of the embedded engine, kept so that it can be undone.

The last weightsync commit can be undone until the next update begins
(`CommitHistory.rollback`): it keeps what was served before it (the tensors,
buffers, version and label: `served.ServedState`, the same storages) and the LoRA
adapters it loaded and evicted, so a push to several replicas can put the replicas
that committed back on their last version when another replica could not commit.
The buffers it stopped serving from go back to the receive pool when the commit
becomes final (the next update begins), before any byte of that update arrives.

Callers hold the updater's lock (`server.updates.WeightUpdater`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from weightsync.errors import ConflictError
from weightsync.receive.update_session import OpenUpdate
from weightsync.server import lora
from weightsync.server.served import ServedState, ServedWeights

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LastCommit:
    """What the last weightsync commit replaced, so that it can be undone."""

    version: int
    owner: str | None
    before: ServedState
    """What was served before it."""
    replaced: list[torch.Tensor] = field(default_factory=list)
    """Receive buffers it stopped serving from: back to the pool once it is final."""
    adapter: str | None = None
    """The LoRA adapter it loaded."""
    evicted: list[lora.Adapter] = field(default_factory=list)
    """Adapters the store evicted to load it."""


class CommitHistory:
    """The last weightsync commit of one engine while it can still be rolled back."""

    def __init__(self, weights: ServedWeights, lora_store: lora.LoraStore | None, *, timeout_s: float) -> None:
        """`timeout_s`: how long unloading the adapter a rolled-back commit loaded may wait."""
        self.weights = weights
        self.lora_store = lora_store
        self.timeout_s = timeout_s
        self._last: LastCommit | None = None

    def record(self, update: OpenUpdate) -> LastCommit:
        """What a commit of `update` is about to replace; the previous commit is final.
        `keep` it once the commit succeeded."""
        self.make_final()
        return LastCommit(version=update.version, owner=update.owner, before=self.weights.saved())

    def keep(self, last: LastCommit) -> None:
        """`last` committed: it can be rolled back until the next update begins."""
        self._last = last

    def make_final(self) -> None:
        """The last commit can no longer be rolled back: its replaced buffers go back to the pool."""
        last, self._last = self._last, None
        if last is not None:
            self.weights.buffers.give(last.replaced)

    def kept_bytes(self) -> int:
        """Bytes held only to roll the last commit back: the storages served before it that
        nothing serves now (each counted once; a bucket buffer and its views share one)."""
        last = self._last
        if last is None:
            return 0
        now = self.weights.saved()
        served = {t.untyped_storage().data_ptr() for t in [*now.params.values(), *now.backing.values()]}
        kept: dict[int, int] = {}  # storage address -> its bytes
        for tensor in [*last.before.params.values(), *last.before.backing.values()]:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in served:
                kept[storage.data_ptr()] = storage.nbytes()
        return sum(kept.values())

    def forget(self) -> None:
        """The weights the last commit replaced are gone (released or resumed): nothing to roll back to."""
        self._last = None

    def rollback(self, version: int, *, owner: str | None = None) -> bool:
        """Undo the commit of `version`: serve again, bit for bit, the weights, version and
        adapters served before it. True if it was undone; False if `version` is not served
        here (it never committed: nothing to undo). Refused (ConflictError) once the commit
        is final (another update began since) or when it was another trainer's."""
        last = self._last
        if last is None or last.version != version:
            if self.weights.version != version:
                return False
            raise ConflictError(f"v{version} cannot be rolled back here: it is final (an update began since "
                                "it committed, it was committed streamed, or it was not a weightsync commit)")
        if owner is not None and last.owner not in (None, owner):
            raise ConflictError(f"v{version} was committed by another trainer ({last.owner}); not rolled back")
        self._last = None
        if last.adapter is not None:
            assert self.lora_store is not None
            self.lora_store.unload(last.adapter, timeout_s=self.timeout_s)
            for adapter in last.evicted:
                self.lora_store.add(adapter, pinned=adapter.pinned)
        self.weights.restore(last.before)
        log.info("v%d rolled back: v%d (%r) served again", version, last.before.served.version,
                 last.before.served.label)
        return True


__all__ = ["CommitHistory", "LastCommit"]
