"""`MemoryEngine`: an engine whose weights are a dict, for the coordinator's unit tests
(tests/unit/test_sync.py and the tests of what drives a `WeightSync`).

It receives through the real `weightsync.receive.update_session.UpdateSession` (so those tests run
the engines' receiving code too) and only adds failure injection and call counting.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import torch

from weightsync.engines.base import EngineCapabilities, EngineUpdate, PausePolicy
from weightsync.errors import ConflictError, EngineError, SyncTimeoutError
from weightsync.formats.version_dir import read_version
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta, Manifest, TensorMeta
from weightsync.receive.update_session import OpenUpdate, UpdateSession
from weightsync.reports import Ack
from weightsync.transports.shmem import SharedSlots


class MemoryEngine:
    """An engine whose weights are a dict; the `receive.update_session.Applier` of a real update session."""

    transports: ClassVar[frozenset[str]] = frozenset({"http", "shm", "disk"})
    lora_transports: ClassVar[frozenset[str]] = frozenset({"http"})
    url: str | None = None  # in this process
    transports_note: str | None = None

    def __init__(self, weights: dict[str, torch.Tensor], label: str = "memory", *, rolls_back: bool = False) -> None:
        self.label = label
        self.rolls_back = rolls_back
        self.previous: tuple[dict[str, torch.Tensor], int] | None = None
        """What the last commit replaced, while it can be rolled back."""
        self.fail_commit = False
        self.weights = {k: v.clone() for k, v in weights.items()}
        self.version = 0
        self.session = UpdateSession(self, engine=label)
        self.calls: list[str] = []
        self.fail_receive_at: int | None = None
        self.hang_receive_at: int | None = None
        self.hang_pause = False
        self.unhang = threading.Event()
        self.corrupt_ack = False
        self.paused = False
        self.lose_pause_answer = False
        self.max_concurrent = 0
        self._inflight = 0
        self._lock = threading.Lock()

    # -- the engine, as the coordinator sees it -----------------------------------------------

    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        self.calls.append("capabilities")
        return EngineCapabilities(stages_updates=True, rolls_back=self.rolls_back)

    def connect(self, link: Link) -> None:
        self.calls.append("connect")

    def disconnect(self, link: Link) -> None:
        self.calls.append("disconnect")

    def pause(self, policy: PausePolicy, *, pause_id: str | None = None, timeout_s: float | None = None) -> None:
        self.calls.append(f"pause:{policy.value}")
        if self.hang_pause:
            self.unhang.wait(60)
        self.paused = True
        if self.lose_pause_answer:  # paused, and the answer never came (vLLM applies a late /pause)
            raise SyncTimeoutError(f"{self.label}: pause: injected lost answer")

    def resume(self, *, pause_id: str | None = None, timeout_s: float | None = None) -> None:
        self.calls.append("resume")
        self.paused = False

    def begin(self, manifest: Manifest, update: EngineUpdate) -> None:
        self.calls.append("begin")
        with self._as_engine_errors():
            self.session.begin(manifest)

    def receive(self, bucket: BucketMeta, delivery: Delivery, update: EngineUpdate) -> None:
        with self._lock:
            self._inflight += 1
            self.max_concurrent = max(self.max_concurrent, self._inflight)
        try:
            self.calls.append(f"receive:{bucket.index}")
            if bucket.index == self.fail_receive_at:
                raise EngineError(self.label, f"injected failure at bucket {bucket.index}", status=400)
            if bucket.index == self.hang_receive_at:
                self.unhang.wait(60)
            if delivery.transport == "http":
                data = delivery.data.clone()
            else:
                link = update.link
                seg = SharedSlots.open(link.shm_name, slot_bytes=link.slot_bytes, num_slots=link.num_slots)
                data = seg.slot(delivery.slot, bucket.nbytes).clone()
            with self._as_engine_errors():
                self.session.stage_bucket(version=update.version, index=bucket.index, buffer=data,
                                          digest_hex=bucket.digest)
        finally:
            with self._lock:
                self._inflight -= 1

    def ready(self, manifest: Manifest, update: EngineUpdate) -> None:
        self.calls.append("ready")
        with self._as_engine_errors():
            if self.session.open_update is None or self.session.open_update.version != manifest.version:
                raise ConflictError(f"update v{manifest.version} is no longer open")

    def commit(self, manifest: Manifest, update: EngineUpdate) -> Ack:
        self.calls.append("commit")
        if self.fail_commit:
            raise EngineError(self.label, "injected failure at commit", status=None)
        with self._as_engine_errors():
            if update.link.transport == "disk":
                _, buckets = read_version(Path(update.link.version_dir(manifest.version)))
                for bucket, data in buckets:
                    self.session.stage_bucket(version=manifest.version, index=bucket.index, buffer=data)
            ack = self.session.commit(manifest.version)
        if self.corrupt_ack:
            ack = replace(ack, digests=("0" * 16, *ack.digests[1:]))
        return ack

    def abort(self, update: EngineUpdate, *, timeout_s: float | None = None) -> None:
        self.calls.append("abort")
        self.session.abort(update.version)

    def rollback(self, version: int, *, owner: str | None = None, timeout_s: float | None = None) -> bool:
        self.calls.append("rollback")
        assert self.rolls_back, "the coordinator rolls back only engines that declare it"
        if self.previous is None or self.version != version:
            return False
        (self.weights, self.version), self.previous = self.previous, None
        return True

    @contextmanager
    def _as_engine_errors(self) -> Iterator[None]:
        """What a real engine's client makes of a 409 answer."""
        try:
            yield
        except ConflictError as e:
            raise EngineError(self.label, str(e), status=409, retry_after_s=e.retry_after_s) from None

    # -- the receive.update_session.Applier ------------------------------------------------------

    def not_one_version(self) -> str | None:
        return None

    def expected(self) -> dict[str, TensorMeta]:
        return {k: TensorMeta.of(k, v) for k, v in self.weights.items()}

    def check_adapter(self, manifest: Manifest) -> None:
        raise ConflictError(f"{self.label} holds no adapters")

    def apply(self, update: OpenUpdate) -> Sequence[str]:
        self.previous = dict(self.weights), self.version
        self.weights.update(update.tensors)
        self.version = update.version
        return list(update.tensors)

    def install_adapter(self, update: OpenUpdate) -> None:
        raise AssertionError("check_adapter refuses every adapter")

    def release(self, update: OpenUpdate) -> None:
        pass
