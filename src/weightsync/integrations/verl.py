"""weightsync as verl 0.9.1's checkpoint-engine backend `"weightsync"`.

verl imports this module on every Ray worker (`checkpoint_engine.custom_backend_module`), which
registers the backend. It holds verl's plug-in surface only: options (`VerlBackendConfig`),
lifecycle, topology and the bridge to the worker's event loop; no byte of a weight is touched
here. The update itself is `integrations.verl_update`, its control channel
`integrations.verl_channel`, its bucket plan `integrations.verl_plan`. How verl drives it and
what it verifies: docs/INTEGRATIONS.md ("verl").
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from weightsync.dtypes import dtype_from_name
from weightsync.formats.groups import UpdateGroup, finish_hosting, host_group, join_group
from weightsync.integrations.verl_channel import VerdictBoard
from weightsync.integrations.verl_update import (
    NamedTensors,
    Session,
    UpdateRefusedError,
    follow_update,
    receive_update,
    send_update,
)
from weightsync.transports import make_receiver, make_transport, parse_link
from weightsync.transports.base import Receiver

BACKEND = "weightsync"
"""The name verl's `checkpoint_engine.backend` selects."""
KEEP_DTYPE = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "block_sparse_moe.gate.weight")
"""`VerlBackendConfig.keep_dtype`'s default: the routers of Qwen-MoE, GLM-4.5, DeepSeek-V3 and
Mixtral checkpoints (a few KiB per layer)."""
TRANSPORTS = ("broadcast", "shm", "disk")
"""What this backend carries: "http" needs weightsync's HTTP engine routes, which verl's
rollout workers do not serve."""


@dataclass(frozen=True, kw_only=True)
class VerlBackendConfig:
    """`checkpoint_engine.engine_kwargs.weightsync`: the same on every worker."""

    transport: str = "broadcast"
    """"broadcast" (a gloo group of the sending actor rank and every rollout rank), "shm"
    (rollout workers on the sending rank's host) or "disk" (needs `disk_root`)."""
    dtype: str | None = "bfloat16"
    """The dtype floating weights travel and are yielded in (the rollout engine's), cast on
    the sending rank; None: as the actor yields them."""
    keep_dtype: tuple[str, ...] = KEEP_DTYPE
    """Name endings of tensors that travel in the dtype the actor yields them in, not
    `dtype`: MoE routers, which vLLM holds in float32 under a bfloat16 model (GLM-4.5 and
    DeepSeek-V3's `mlp.gate.weight` and `e_score_correction_bias`), so a float32 actor's
    values reach them exactly, as verl's own checkpoint engines (which send the actor's
    dtype) deliver them. An engine that holds one in bfloat16 casts it as it loads it,
    which is the same rounding `dtype` would have done."""
    hold_update: bool = True
    """Yield nothing before every rollout rank checked every bucket (all-or-nothing; costs
    host memory for the whole update in `dtype` on each rollout worker). False: yield each
    bucket once checked, so verl's adapter may load part of an update that is then refused."""
    disk_root: str | None = None
    """transport="disk": a directory every worker reads and the sending rank writes."""
    master_address: str | None = None
    """The sending rank's address the rollout workers reach (default: its Ray node address)."""
    timeout_s: float = 300.0
    """Bound on every collective and wait of an update."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"engine_kwargs.weightsync.transport={self.transport!r}; this backend carries "
                             f"{', '.join(TRANSPORTS)}")
        if self.transport == "disk" and not self.disk_root:
            raise ValueError("engine_kwargs.weightsync.transport='disk' needs disk_root=<a directory every actor and "
                             "rollout worker reads>")
        if self.dtype is not None:
            dtype_from_name(self.dtype)
        if isinstance(self.keep_dtype, str) or not all(isinstance(k, str) and k for k in self.keep_dtype):
            raise ValueError(f"engine_kwargs.weightsync.keep_dtype must be a list of name endings, got "
                             f"{self.keep_dtype!r}")
        object.__setattr__(self, "keep_dtype", tuple(self.keep_dtype))
        if self.timeout_s <= 0:
            raise ValueError(f"engine_kwargs.weightsync.timeout_s must be positive, got {self.timeout_s}")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return dtype_from_name(self.dtype) if self.dtype is not None else None

    @classmethod
    def from_kwargs(cls, engine_kwargs: dict[str, Any]) -> VerlBackendConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine_kwargs.weightsync option(s) {unknown}; valid: {sorted(known)}")
        return cls(**engine_kwargs)


@CheckpointEngineRegistry.register(BACKEND)
class WeightSyncCheckpointEngine(CheckpointEngine):
    """verl's `CheckpointEngine` over weightsync's bucketing, digests and transports.

    Built by verl with `bucket_size` (bytes), `is_master` (actor rank 0) and the
    `engine_kwargs.weightsync` options (`VerlBackendConfig`).
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        if bucket_size <= 0:
            raise ValueError(f"bucket_size must be positive, got {bucket_size}")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.config = VerlBackendConfig.from_kwargs(engine_kwargs)
        self.receiver: Receiver = make_receiver(self.config.transport, max_sessions=1)
        """The engine side of the transport (used on rollout ranks), kept across updates."""
        self.version = 0
        """The last version this rank sent (actor) or handed to verl's adapter (rollout)."""
        self._hosting: UpdateGroup | None = None
        self._session: Session | None = None

    # -- verl's lifecycle ---------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        self._close()
        master = None
        if self.is_master:
            address = self.config.master_address or _node_address()
            group_name = f"weightsync-verl-{secrets.token_hex(6)}"
            # the group's size is known at init_process_group; the store does not wait for it
            self._hosting, port = host_group(master_address=address, world_size=2, group_name=group_name,
                                             backend="gloo", timeout_s=self.config.timeout_s)
            master = {"address": address, "port": port, "group_name": group_name}
        return {"master": master, "transport": self.config.transport, "host": socket.gethostname()}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ValueError(f"{len(metadata)} prepare() results for {actor_wg_world_size} actor and "
                             f"{rollout_world_size} rollout workers")
        master = metadata[0]["master"]
        if master is None:
            raise ValueError("actor rank 0 hosts no weightsync group: build its checkpoint engine with is_master=True "
                             "(verl's actor worker passes is_master=(torch.distributed.get_rank() == 0))")
        transports = {m["transport"] for m in metadata}
        if len(transports) != 1:
            raise ValueError(f"workers disagree on engine_kwargs.weightsync.transport: {sorted(transports)}; "
                             "give every worker the same checkpoint_engine config")
        if transports == {"shm"}:
            away = [f"rollout worker {i} on {m['host']!r}" for i, m in enumerate(metadata[actor_wg_world_size:])
                    if m["host"] != metadata[0]["host"]]
            if away:
                raise ValueError(f"transport='shm' needs every rollout worker on the sending actor's host "
                                 f"{metadata[0]['host']!r}: {', '.join(away)}; use transport='broadcast'")
        world_size = 1 + rollout_world_size
        actor_kwargs = {"rank": [0] + [-1] * (actor_wg_world_size - 1),
                        "world_size": [world_size] * actor_wg_world_size, "master": [master] * actor_wg_world_size}
        rollout_kwargs = {"rank": list(range(1, world_size)), "world_size": [world_size] * rollout_world_size,
                          "master": [master] * rollout_world_size}
        return actor_kwargs, rollout_kwargs

    def init_process_group(  # type: ignore[override]  # verl declares **kwargs: build_topology's keys
            self, *, rank: int, world_size: int, master: dict[str, Any]) -> None:
        """Rank 0 forms the control group and opens the transport session; rollout ranks
        join both; the other actor ranks connect to the verdict board only."""
        timeout_s = self.config.timeout_s
        session = Session(rank=rank, timeout_s=timeout_s)
        if rank < 0:
            session.board = VerdictBoard.connect(host=master["address"], port=master["port"],
                                                 group_name=master["group_name"], timeout_s=timeout_s)
        elif rank == 0:
            if self._hosting is None:
                raise ValueError("init_process_group(rank=0) on a worker whose prepare() hosted no group "
                                 "(is_master=False)")
            hosting, self._hosting = self._hosting, None
            hosting.world_size = world_size
            session.group = finish_hosting(hosting, timeout_s=timeout_s)
            session.board = VerdictBoard(hosting.store, group_name=master["group_name"])
            transport = make_transport(self.config.transport, timeout_s=timeout_s, disk_root=self.config.disk_root,
                                       master_address=master["address"], backend="gloo")
            session.transport = transport
            links = transport.open([1] * (world_size - 1), max_bucket_bytes=self.bucket_size)
            session.channel.announce({"kind": "links", "links": [link.to_dict() for link in links]})
            transport.establish()
        else:
            session.group = join_group(master_address=master["address"], master_port=master["port"], rank=rank,
                                       world_size=world_size, group_name=master["group_name"], backend="gloo",
                                       timeout_s=timeout_s)
            links = session.channel.announce(None)["links"]
            session.receiver = self.receiver
            session.link = parse_link(links[rank - 1])
            self.receiver.join(session.link, rank=0)
        self._session = session

    def finalize(self) -> None:
        self._close()

    # -- the update ---------------------------------------------------------------------

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator[tuple[str, torch.Tensor]],
                           global_steps: int | None = None) -> dict[str, Any]:
        """Every actor rank calls this with the same weights (verl's FSDP generator gathers
        each tensor on every rank); rank 0 sends, the others iterate and wait for its
        verdict. Returns verl's sync metrics; raises UpdateRefusedError on every actor rank
        when any rollout rank refused or was lost."""
        session = self._require_session()
        if session.rank > 0:
            raise ValueError(f"rollout rank {session.rank} cannot send weights; verl calls send_weights on actor ranks")
        version = global_steps if global_steps is not None else self.version + 1
        stream = _blocking_stream(weights, asyncio.get_running_loop())
        if session.rank < 0:
            metrics = await asyncio.to_thread(follow_update, session, stream)
        else:
            metrics = await asyncio.to_thread(
                send_update, session, stream, version=version, bucket_bytes=self.bucket_size,
                dtype=self.config.torch_dtype, keep_dtype=self.config.keep_dtype,
                max_tensor_bytes=self.bucket_size if self.config.transport == "shm" else None)  # shm slots: fixed size
        self.version = version
        return metrics

    async def receive_weights(  # type: ignore[override]  # verl annotates its async generators as Generator
            self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """`(name, tensor)` of the update, in the engine dtype; with `hold_update`, none before
        every rollout rank checked every bucket. The tensors are views of this rank's
        received buffers, valid while verl's adapter holds them."""
        session = self._require_session()
        if session.rank <= 0:
            raise ValueError("receive_weights runs on rollout ranks; verl calls it from CheckpointEngineWorker")
        loop = asyncio.get_running_loop()
        handoff: asyncio.Queue[NamedTensors | _Finished] = asyncio.Queue(maxsize=1)
        consumer_gone = threading.Event()

        def emit(named: NamedTensors) -> None:
            if not consumer_gone.is_set():
                asyncio.run_coroutine_threadsafe(handoff.put(named), loop).result()

        def run() -> None:
            try:
                outcome = _Finished(version=receive_update(session, global_steps=global_steps,
                                                           loaded_version=self.version,
                                                           hold=self.config.hold_update, emit=emit))
            except BaseException as e:  # handed to the consumer, which raises it
                outcome = _Finished(error=e)
            asyncio.run_coroutine_threadsafe(handoff.put(outcome), loop).result()

        worker = loop.run_in_executor(None, run)
        finished = False
        try:
            while True:
                item = await handoff.get()
                if isinstance(item, _Finished):
                    finished = True
                    if item.error is not None:
                        raise item.error
                    assert item.version is not None
                    self.version = item.version
                    return
                for pair in item:
                    yield pair
        finally:
            consumer_gone.set()
            while not finished:  # the adapter stopped early: let the update run out
                finished = isinstance(await handoff.get(), _Finished)
            await worker

    # -- internals ----------------------------------------------------------------------

    def _require_session(self) -> Session:
        if self._session is None:
            raise ValueError("no weightsync session: verl calls prepare(), build_topology() and init_process_group() "
                             "before each update")
        return self._session

    def _close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
        self._hosting = None


@dataclass(frozen=True, kw_only=True)
class _Finished:
    """The end of a rollout rank's update: its version, or why it failed."""

    version: int | None = None
    error: BaseException | None = None


def _blocking_stream(weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator[tuple[str, torch.Tensor]],
                     loop: asyncio.AbstractEventLoop) -> Iterator[tuple[str, torch.Tensor]]:
    """verl's weights as a plain iterator for the update thread (an async generator is
    advanced on the worker's event loop, as verl's own engines read it)."""
    if not isinstance(weights, AsyncIterator):
        yield from weights
        return

    async def step() -> tuple[str, torch.Tensor]:
        return await anext(weights)

    while True:
        try:
            yield asyncio.run_coroutine_threadsafe(step(), loop).result()
        except StopAsyncIteration:
            return


def _node_address() -> str:
    """This worker's Ray node address (what verl's own engines advertise), else loopback."""
    import ray

    return ray.util.get_node_ip_address().strip("[]") if ray.is_initialized() else "127.0.0.1"


__all__ = ["BACKEND", "UpdateRefusedError", "VerlBackendConfig", "WeightSyncCheckpointEngine"]
