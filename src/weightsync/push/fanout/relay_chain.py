"""The trainer's side of a relay among engines in a broadcast group (`fan_out="relay"` over
"broadcast"): after begin every engine starts its hop (take the buckets from the rank before
it, check, stage, send them to the next rank), the trainer sends each bucket to the first
engine's rank only, and where its hop breaks, finds which engine says why.

gloo closes all of a process's connections when one of its operations times out, so a hop
further down the chain that stalled breaks the trainer's hop too: the error names the engine
that recorded the cause (`Relayer.relay_error`), asked for up to `RELAY_CAUSE_S`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from weightsync.engines.base import EngineUpdate, Relayer, verbs_of
from weightsync.errors import EngineError, SyncTimeoutError, WeightSyncError
from weightsync.manifest import BucketMeta, Manifest
from weightsync.push.fanout.base import Round, relayer

RELAY_CAUSE_S = 2.0
"""How long the trainer asks the engines of a relay in a group why it stopped, after its own
hop failed (the engine whose hop failed records why a moment after the trainer sees it)."""


class RelayChain:
    """The hops of one relay in a group (`push.fanout.relay`), in the engines' order."""

    def __init__(self, replicas: Round) -> None:
        self.replicas = replicas
        self.version: int | None = None
        """The version relayed now (the trainer's first hop names the engines' errors)."""

    def start(self, manifest: Manifest) -> None:
        """Relayed over a group: every engine starts taking the buckets of `manifest` from
        the rank before it (the first: the trainer's) and sending them to the next one's."""
        replicas = self.replicas
        self.version = manifest.version
        hops = [(e.label, update.link) for e, update in zip(replicas.engines, replicas.updates, strict=True)]
        position = {id(e): i for i, e in enumerate(replicas.engines)}

        def start(engine: Any, update: EngineUpdate) -> None:
            i = position[id(engine)]
            forward = hops[i + 1] if i + 1 < len(hops) else None
            update.forwards = forward is not None
            relayer(engine, replicas.timeout_s).relay_in_group(manifest, update, source=hops[i - 1] if i else None,
                                                               forward=forward)

        replicas.all(start, "starting its relay in the group")

    def send_first_hop(self, bucket: BucketMeta, send: Callable[[], None]) -> None:
        """The trainer's hop of a relay in a group: `bucket` to the first engine's rank; an
        error names that engine and the hop."""
        first = self.replicas.engines[0].label
        try:
            send()
        except WeightSyncError as e:
            what = f"sending it bucket {bucket.index} (the relay's first hop, from the trainer)"
            if isinstance(e, SyncTimeoutError):  # this hop is the slow one
                raise SyncTimeoutError(f"{first}: {what}: {e}") from e
            # gloo closes a process's connections when one of its operations times out: a hop
            # further down that timed out breaks this one too, and that engine says which
            cause = self._cause()
            if cause is not None:
                label, message = cause
                raise EngineError(label, f"relay of v{self.version}: {message}") from e
            raise EngineError(first, f"{what} failed: {e}") from e

    def _cause(self) -> tuple[str, str] | None:
        """(label, error) of the first engine, in relay order, that says why the relay of the
        version under way stopped there, asked for up to `RELAY_CAUSE_S`; None if none does."""
        version = self.version
        if version is None:
            return None
        limit_s = min(RELAY_CAUSE_S, self.replicas.timeout_s)
        deadline = time.monotonic() + limit_s
        asking: dict[int, Future[str | None]] = {}
        while time.monotonic() < deadline:
            # each asked again once it answered: a silent one holds none up
            for i, engine in enumerate(self.replicas.engines):
                verbs = verbs_of(engine, limit_s)
                if isinstance(verbs, Relayer) and (i not in asking or asking[i].done()):
                    asking[i] = self.replicas.pool.submit(verbs.relay_error, version, timeout_s=limit_s)
            time.sleep(0.05)
            for i, future in sorted(asking.items()):
                if future.done() and future.exception() is None and (error := future.result()) is not None:
                    return self.replicas.engines[i].label, error
        return None
