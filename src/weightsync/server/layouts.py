"""Layouts an engine remembers, so that a trainer pushing the same plan again names it
instead of sending it (docs/PROTOCOL.md, "Begin by layout").

A layout is a manifest's buckets without their digests, remembered for the last few accepted
begins under a digest this engine computes from what it parsed (never one a trainer gave). It saves
the parse only: `server/updates.py` checks a begin by layout as it checks a whole one. Pure
bookkeeping: no I/O. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from weightsync.manifest import BucketMeta, Manifest

MAX_LAYOUTS = 4
"""Layouts remembered at most (the latest ones begun): a trainer alternating a few
modes (full, lora) finds each of them."""


class Layouts:
    """The layouts of the last `max_layouts` begins an engine accepted, by digest."""

    def __init__(self, max_layouts: int = MAX_LAYOUTS) -> None:
        if max_layouts < 1:
            raise ValueError(f"max_layouts must be at least 1, got {max_layouts}")
        self.max_layouts = max_layouts
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[BucketMeta, ...]] = OrderedDict()
        self.num_by_layout = 0
        """Begins accepted that named a remembered layout."""
        self.num_whole = 0
        """Begins accepted that sent their buckets whole."""
        self.num_unknown = 0
        """Begins refused for naming a layout not remembered."""

    def get(self, layout: str) -> tuple[BucketMeta, ...] | None:
        """The buckets of remembered layout `layout` (their digests as last begun), or None
        (counted as a refusal: the caller answers 409 "unknown_layout")."""
        with self._lock:
            buckets = self._buckets.get(layout)
            if buckets is None:
                self.num_unknown += 1
            return buckets

    def remember(self, manifest: Manifest, *, by_layout: bool) -> str:
        """Remember the layout of `manifest`, a begin this engine accepted (its dry run passed),
        `by_layout` or sent whole; returns its digest, computed here from the parsed buckets."""
        layout = manifest.layout_digest
        with self._lock:
            if by_layout:
                self.num_by_layout += 1
            else:
                self.num_whole += 1
            self._buckets[layout] = manifest.buckets
            self._buckets.move_to_end(layout)
            while len(self._buckets) > self.max_layouts:
                self._buckets.popitem(last=False)
        return layout

    def forget(self) -> None:
        """Remember none (a trainer's next begin is sent whole)."""
        with self._lock:
            self._buckets.clear()

    def info(self) -> dict[str, Any]:
        """For /weightsync/info: the digests remembered (latest last) and the begins counted."""
        with self._lock:
            return {"remembered": list(self._buckets), "begins_by_layout": self.num_by_layout,
                    "begins_whole": self.num_whole, "unknown": self.num_unknown}


__all__ = ["MAX_LAYOUTS", "Layouts"]
