"""mode="delta": only the tensors whose bytes changed since the version every engine acked.

The mode remembers the digest of every tensor as the engines hold it (after the
cast to their dtype) from the last acked push, and sends the tensors whose digest
differs, each with the other tensors of its fused group where an engine loads
some only together (`EngineCapabilities.fused_groups`). The manifest names that
acked version as `base_version`; an engine that cannot prove it holds it
(restarted, or another trainer pushed since) refuses at begin with 409, and the
same push goes out whole. With nothing acked yet, or an
engine that does not apply partial updates (`supports_delta`), pushes go out whole.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar

from weightsync.errors import EngineError
from weightsync.modes.base import ModeDefaults, ModeOptions, Planner, PushMode, Selection
from weightsync.sources import WeightSource

log = logging.getLogger(__name__)


class DeltaMode(ModeDefaults):
    """Changed tensors on top of the last acked version."""

    name: ClassVar[str] = "delta"

    def __init__(self, options: ModeOptions | None = None) -> None:
        super().__init__(options)
        self.acked_version: int | None = None
        """The version every engine acked last (None: none, or an engine refused it)."""
        self._held: dict[str, str] = {}
        """hf_name -> digest of what the engines hold at `acked_version`."""
        self._pending: tuple[int, dict[str, str]] | None = None
        """(version, digests) of the push under way, kept for a retry after a refusal."""

    def prepare(self, model: Any, version: int, planner: Planner) -> Sequence[PushMode]:
        self._pending = None  # digests are taken afresh for every push
        return ()

    def select(self, source: WeightSource, version: int, planner: Planner) -> Selection:
        metas = list(planner.metas(source))
        if not all(c.supports_delta for c in planner.capabilities):
            return Selection(mode="full", metas=metas)  # an engine that cannot apply a part gets the whole
        if self._pending is None:  # asked again after a refusal: the same digests
            self._pending = (version, planner.hash_tensors(source, cast=self.casts))
        digests = self._pending[1]
        if self.acked_version is None:
            return Selection(mode="full", metas=metas)  # nothing acked yet: the first delta is the whole model
        sent = {m.hf_name for m in metas if self._held.get(m.hf_name) != digests[m.hf_name]}
        for groups in (c.fused_groups for c in planner.capabilities):
            sent |= {hf_name for group in groups if not sent.isdisjoint(group) for hf_name in group}
        changed = [m for m in metas if m.hf_name in sent]
        return Selection(mode="delta", metas=changed, num_skipped=len(metas) - len(changed),
                         base_version=self.acked_version)

    def refused(self, selection: Selection, error: EngineError) -> bool:
        if selection.mode != "delta" or error.status != 409:
            return False
        log.info("delta refused (%s); sending the whole model instead", error)
        self.acked_version = None
        return True

    def committed(self, selection: Selection, version: int, planner: Planner) -> None:
        self.acked_version = version
        if self._pending is not None and self._pending[0] == version:
            self._held = self._pending[1]
        self._pending = None
