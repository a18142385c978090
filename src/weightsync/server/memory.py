"""SGLang's memory occupation tags on the embedded engine: which regions
`/release_memory_occupation` releases and what that means for serving ("weights" frees the
served parameters; "kv_cache" and "cuda_graph" free nothing that outlives a request here).
What each tag does: docs/PROTOCOL.md ("Details of the embedded engine").
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from weightsync.errors import ConflictError
from weightsync.server.scheduler import Scheduler
from weightsync.server.updates import WeightUpdater

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
CUDA_GRAPH = "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
"""SGLang's GPU_MEMORY_ALL_TYPES, in its order."""


def parse_tags(value: Any) -> list[str]:
    """SGLang's `tags` field: null or [] -> every tag; otherwise known tag names."""
    if value is None or value == []:
        return list(ALL_TAGS)
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"field 'tags' must be a list of strings (some of {list(ALL_TAGS)}) or null, "
                         f"got {value!r:.80}")
    unknown = [t for t in value if t not in ALL_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown} in 'tags'; use some of {list(ALL_TAGS)}")
    return list(dict.fromkeys(value))


class MemoryOccupation:
    """The released tags of one engine."""

    def __init__(self, updater: WeightUpdater, scheduler: Scheduler) -> None:
        self.updater = updater
        self.scheduler = scheduler
        self.released: set[str] = set()
        self._lock = threading.Lock()

    def release(self, tags: Iterable[str]) -> dict[str, Any]:
        """Release `tags`; returns what was freed (`freed_bytes`)."""
        tags = list(tags)
        with self._lock:
            if not self.scheduler.is_idle() and self.scheduler.paused is None:
                raise ConflictError(
                    f"release_memory_occupation needs an idle engine: {self.scheduler.num_running} running and "
                    f"{self.scheduler.num_waiting} waiting request(s); /pause_generation or "
                    "/abort_request {\"abort_all\": true} first")
            if self.scheduler.num_running:
                raise ConflictError(f"{self.scheduler.num_running} request(s) still hold KV caches; "
                                    "/pause_generation with mode 'abort' or 'retract' first")
            freed = 0
            if WEIGHTS in tags and WEIGHTS not in self.released:
                freed += self.updater.release_weights()
            self.released.update(tags)
            return {"released": sorted(self.released), "freed_bytes": freed}

    def resume(self, tags: Iterable[str]) -> dict[str, Any]:
        tags = list(tags)
        with self._lock:
            missing = [t for t in tags if t not in self.released]
            if missing:
                raise ConflictError(f"memory tag(s) {missing} are not released (released: {sorted(self.released)})")
            allocated = self.updater.resume_weights() if WEIGHTS in tags else 0
            self.released.difference_update(tags)
            return {"released": sorted(self.released), "allocated_bytes": allocated}

    def unservable(self) -> str | None:
        """Why generation must be refused for memory reasons, or None."""
        if KV_CACHE in self.released:
            return "the KV cache is released by /release_memory_occupation; call /resume_memory_occupation first"
        return None
