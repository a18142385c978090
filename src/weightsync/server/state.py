"""Everything the routes share, built once at startup: model runner (over a quantized
checkpoint dequantized, `server.quantized`), scheduler,
weight updater (with its receive path, `weightsync.receive.receive_path`, the one way
bytes reach its update session), LoRA store and the weight-update groups this engine
joined (SGLang's group routes).
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field

from weightsync.formats.groups import UpdateGroup
from weightsync.formats.shares import Assembly
from weightsync.receive.receive_path import ReceivePath
from weightsync.server.config import ServerConfig
from weightsync.server.lora import LoraStore
from weightsync.server.memory import MemoryOccupation
from weightsync.server.quantized import load_quantized, read_served_quantization
from weightsync.server.relay import Relay
from weightsync.server.runner import ModelRunner
from weightsync.server.scheduler import Scheduler
from weightsync.server.updates import WeightUpdater

log = logging.getLogger(__name__)


@dataclass(eq=False)
class JoinedGroup:
    """A weight-update group and the lock that keeps its broadcasts in order."""

    group: UpdateGroup
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(eq=False)
class ServerState:
    config: ServerConfig
    runner: ModelRunner
    scheduler: Scheduler
    updater: WeightUpdater
    lora_store: LoraStore | None
    memory: MemoryOccupation
    """The memory tags released by /release_memory_occupation."""
    relay: Relay = field(default_factory=Relay)
    """Where this engine forwards the buckets of a relayed push (`weightsync.server.relay`)."""
    assembly: Assembly = field(default_factory=Assembly)
    """The buckets arriving in shares, one per trainer rank (`weightsync.formats.shares`)."""
    groups: dict[str, JoinedGroup] = field(default_factory=dict)
    groups_lock: threading.Lock = field(default_factory=threading.Lock)
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Drawn when this server process started: a client that sees another one knows the
    engine restarted (and serves its checkpoint's weights again)."""
    model_path: str | None = None
    """The `model_path` of the last `/update_weights_from_disk` that was applied
    (None: the model directory the server started with)."""

    @classmethod
    def build(cls, config: ServerConfig) -> ServerState:
        """Load the model and start the step thread."""
        if config.num_threads is not None:
            import torch

            torch.set_num_threads(config.num_threads)
        quantized = read_served_quantization(config.model_dir)
        runner = ModelRunner(config.model_dir,
                             model=load_quantized(config.model_dir, quantized) if quantized is not None else None)
        lora_store = LoraStore(runner.model, max_loaded=config.max_loaded_loras) if config.enable_lora else None
        runner.lora = lora_store
        updater_box: list[WeightUpdater] = []
        scheduler = Scheduler(
            runner,
            max_running=config.max_running,
            served=lambda: updater_box[0].weights.served,
            release_adapter=lora_store.release if lora_store is not None else None,
            hold=lambda: updater_box[0].holding(),
            refusal=lambda: updater_box[0].weights.coverage.refusal(),
            on_held=lambda: updater_box[0].expire_silent(),
        )
        label = config.weight_version
        version = int(label) if label.isascii() and label.isdigit() else 0
        updater = WeightUpdater(runner.model, version=version, label=label, between_steps=scheduler.between_steps,
                                session_timeout_s=config.session_timeout_s, lora_store=lora_store,
                                staging_bytes_limit=config.staging_bytes_limit, quantized=quantized)
        updater_box.append(updater)
        scheduler.start()
        return cls(config=config, runner=runner, scheduler=scheduler, updater=updater, lora_store=lora_store,
                   memory=MemoryOccupation(updater, scheduler))

    @property
    def receive_path(self) -> ReceivePath:
        """The one way bytes reach the updater's session: every route that stages a bucket
        hands it here (`WeightUpdater.receive_path`)."""
        return self.updater.receive_path

    def close(self) -> None:
        self.scheduler.stop()
        self.receive_path.close()
        self.relay.close()
        with self.groups_lock:
            for joined in self.groups.values():
                joined.group.destroy()
            self.groups.clear()
