"""Weight-update process groups, formed exactly as SGLang's `init_weights_update_group` forms them.

The trainer is rank 0 (TCP store host, broadcast source); engine ranks join as `rank_offset + tp_rank`
through a `PrefixStore(group_name)`. A side group: no default process group is needed or touched.
Across hosts each gloo rank binds the address its peers can reach (`hosts.local_address_towards`,
unless GLOO_SOCKET_IFNAME is set). Every collective, and the group's forming, runs on a worker thread
that the caller waits for at most `timeout_s` (`_bounded`): NCCL blocks inside the call that builds its
communicator, where no `Work.wait(timeout)` reaches; gloo takes the same path. Used by the broadcast
transport (trainer), the embedded server and the vLLM worker (engines); the rendezvous in full:
docs/ENGINES.md ("SGLang").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

from weightsync.errors import SyncTimeoutError, WeightSyncError
from weightsync.hosts import local_address_towards

log = logging.getLogger(__name__)

T = TypeVar("T")

ABORT_TIMEOUT_S = 10.0
"""Longest the caller waits for NCCL's abort of a group whose collective outran its bound."""

MAX_WORLD_SIZE = 1 << 16
"""Largest weight-update group accepted (torch's store takes a C int; beyond it raises TypeError)."""


@dataclass
class UpdateGroup:
    """A formed weight-update group and the store that formed it."""

    group: dist.ProcessGroup
    store: dist.Store
    rank: int
    world_size: int
    group_name: str
    backend: str
    bind_address: str = ""
    """The address this rank's gloo device binds (the trainer's: master_address)."""
    broken: str | None = None
    """Why the group can no longer be used (a collective outran its bound); None while usable."""

    def _collective(self, issue: Callable[[], dist.Work], tensor: torch.Tensor, timeout_s: float,
                    what: str) -> None:
        """Issue a collective and wait for it, both within `timeout_s` (`_bounded`). Past the
        bound the group is broken for good: NCCL's communicator is aborted, and every later
        call is refused at once."""
        if self.broken is not None:
            raise WeightSyncError(f"{what}: the group is unusable ({self.broken}); form a new one")
        stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None

        def run(deadline: float) -> None:
            if stream is not None:  # the worker thread: the caller's device and stream, so the bytes are ordered
                torch.cuda.set_device(tensor.device)
                with torch.cuda.stream(stream):
                    _wait(issue(), max(deadline - time.monotonic(), 1e-3), what)
                    stream.synchronize()  # the bytes are there when the caller resumes
            else:
                _wait(issue(), max(deadline - time.monotonic(), 1e-3), what)

        try:
            _bounded(run, timeout_s, what)
        except SyncTimeoutError as e:
            self.broken = str(e)
            self.abort()
            raise

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, timeout_s: float) -> None:
        """Broadcast `tensor` from `src`; raises SyncTimeoutError past `timeout_s`."""
        self._collective(lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True), tensor,
                         timeout_s, f"broadcast in group {self.group_name!r}")

    def send(self, tensor: torch.Tensor, *, dst: int, tag: int, timeout_s: float) -> None:
        """Send `tensor` to rank `dst` alone (a relayed push's hop); `tag` pairs it with the
        receiver's `recv`. Raises SyncTimeoutError past `timeout_s`, WeightSyncError when
        the peer is gone."""
        what = f"send to rank {dst} in group {self.group_name!r}"

        def issue() -> dist.Work:
            try:  # group ranks: this side group's own (no global mapping); a pair already broken raises here
                return self.group.send([tensor], dst, tag)
            except RuntimeError as e:
                raise WeightSyncError(f"{what} failed (did a peer die or leave the group?): {e}") from e

        self._collective(issue, tensor, timeout_s, what)

    def recv(self, tensor: torch.Tensor, *, src: int, tag: int, timeout_s: float) -> None:
        """Receive into `tensor` (its exact size) what rank `src` sends with `tag`."""
        what = f"receive from rank {src} in group {self.group_name!r}"

        def issue() -> dist.Work:
            try:
                return self.group.recv([tensor], src, tag)
            except RuntimeError as e:
                raise WeightSyncError(f"{what} failed (did a peer die or leave the group?): {e}") from e

        self._collective(issue, tensor, timeout_s, what)

    def all_gather(self, tensor: torch.Tensor, *, timeout_s: float) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape and dtype on every rank), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._collective(lambda: dist.all_gather(out, tensor, group=self.group, async_op=True), tensor,
                         timeout_s, f"all_gather in group {self.group_name!r}")
        return out

    def gather(self, tensor: torch.Tensor, *, dst: int = 0, timeout_s: float) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape and dtype on every rank) on rank `dst`, in
        rank order; an empty list on the other ranks."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank == dst else None
        self._collective(lambda: dist.gather(tensor, out, dst=dst, group=self.group, async_op=True), tensor,
                         timeout_s, f"gather in group {self.group_name!r}")
        return out or []

    def all_reduce_max(self, tensor: torch.Tensor, *, timeout_s: float) -> None:
        """`tensor` becomes the elementwise maximum over every rank's, in place."""
        self._collective(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                         tensor, timeout_s, f"all_reduce in group {self.group_name!r}")

    def barrier(self, *, timeout_s: float) -> None:
        flag = torch.zeros(1, dtype=torch.uint8)
        self.broadcast(flag, src=0, timeout_s=timeout_s)

    def abort(self) -> None:
        """NCCL: abort the group's communicators, so a collective stuck in them returns (one
        stuck building its communicator may stay blocked on its worker thread; the caller no
        longer waits for it). gloo needs none: its calls end at their own timeout."""
        if self.backend != "nccl" or self.group is None:
            return

        def run(_: float) -> None:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group(self.group)

        try:  # bounded too: an abort that waited on the stuck build would hang the caller
            _bounded(run, ABORT_TIMEOUT_S, f"aborting group {self.group_name!r}")
        except Exception as e:  # best effort: an older torch, already torn down, or stuck
            log.warning("aborting NCCL group %s: %s", self.group_name, e)

    def destroy(self) -> None:
        """Tear the group down; safe to call twice and after a peer died. A broken NCCL group
        was aborted instead (destroying it could wait on the stuck collective)."""
        if self.broken is not None and self.backend == "nccl":
            return
        try:
            dist.destroy_process_group(self.group)
        except (RuntimeError, ValueError, KeyError) as e:  # already gone or never registered
            log.debug("destroying group %s: %s", self.group_name, e)


def _bounded(fn: Callable[[float], T], timeout_s: float, what: str,
             on_abandoned: Callable[[T], None] | None = None) -> T:
    """`fn(deadline)` run on a worker thread, waited for at most `timeout_s`; past it,
    SyncTimeoutError, and the thread is left to end on its own (`on_abandoned` gets what
    it returns if it ever does). `fn` bounds its own waits by `deadline` (time.monotonic)."""
    deadline = time.monotonic() + timeout_s
    done = threading.Event()
    box: dict[str, Any] = {}
    abandoned = threading.Event()
    lock = threading.Lock()

    def run() -> None:
        try:
            box["value"] = fn(deadline)
        except BaseException as e:
            box["error"] = e
        with lock:
            done.set()
            late = abandoned.is_set()
        if late and on_abandoned is not None and "value" in box:
            on_abandoned(box["value"])

    threading.Thread(target=run, name=f"weightsync-{what}"[:60], daemon=True).start()
    finished = done.wait(timeout_s)
    with lock:
        if not finished and not done.is_set():
            abandoned.set()
            raise SyncTimeoutError(f"{what} did not finish within {timeout_s:.1f}s (the call itself blocked: "
                                   "a peer never joined or stopped; NCCL builds its communicator in the first "
                                   "collective)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _wait(work: dist.Work, timeout_s: float, what: str) -> None:
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        text = str(e)
        if "timeout" in text.lower() or "timed out" in text.lower():  # gloo: "Timed out waiting 3000ms ..."
            raise SyncTimeoutError(f"{what} did not finish within {timeout_s:.1f}s: {text}") from e
        raise WeightSyncError(f"{what} failed (did a peer die or leave the group?): {text}") from e
    if ok is False:
        raise SyncTimeoutError(f"{what} did not finish within {timeout_s:.1f}s")


def _new_group(store: dist.Store, *, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float, bind_address: str) -> dist.ProcessGroup:
    """The group as rank `rank`; a gloo rank binds `bind_address` (see the module docstring)."""
    prefix_store = PrefixStore(group_name, store)
    options = None
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        backend, options = _bound_gloo_backend(), bind_address
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        prefix_store,
        group_name=group_name,  # type: ignore[arg-type]
        backend_options=options,
        timeout=timedelta(seconds=timeout_s),
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


BOUND_GLOO = "weightsync_gloo"
"""gloo with its device bound to one address, registered with torch.distributed on first use."""
_register_lock = threading.Lock()


def _bound_gloo_backend() -> str:
    with _register_lock:
        if BOUND_GLOO.upper() not in Backend._plugins:
            Backend.register_backend(BOUND_GLOO, _create_bound_gloo, extended_api=True, devices=["cpu"])
    return BOUND_GLOO


def _create_bound_gloo(options: Any, bind_address: str) -> dist.ProcessGroupGloo:
    """torch's backend factory: `ProcessGroupGloo` whose one device binds `bind_address`."""
    gloo_options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo_options._timeout = options.timeout
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_address)]
    return dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size, gloo_options)


def host_group(*, master_address: str, world_size: int, group_name: str, backend: str,
               timeout_s: float, master_port: int = 0) -> tuple[UpdateGroup, int]:
    """Trainer side, step 1: start the TCP store (port 0 = pick a free one).

    Returns the store-holding handle-to-be and the port engines must use. The
    group itself forms in `finish_hosting` once the engines are joining.
    """
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=True,
        timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
    )
    holder = UpdateGroup(group=None, store=store, rank=0, world_size=world_size,  # type: ignore[arg-type]
                         group_name=group_name, backend=backend, bind_address=master_address)
    return holder, store.port


def finish_hosting(holder: UpdateGroup, *, timeout_s: float) -> UpdateGroup:
    """Trainer side, step 2: form the group as rank 0 (blocks until all ranks join)."""
    what = f"weight-update group {holder.group_name!r}"
    try:
        holder.group = _bounded(
            lambda deadline: _new_group(holder.store, rank=0, world_size=holder.world_size,
                                        group_name=holder.group_name, backend=holder.backend,
                                        timeout_s=max(deadline - time.monotonic(), 1e-3),
                                        bind_address=holder.bind_address),
            timeout_s, f"forming {what}", on_abandoned=_destroy_pg)
    except SyncTimeoutError as e:
        raise SyncTimeoutError(f"{what} did not form within {timeout_s:.1f}s: {e}") from e
    except RuntimeError as e:
        raise SyncTimeoutError(
            f"weight-update group {holder.group_name!r} did not form within {timeout_s:.1f}s: {e}"
            f"{_mesh_hint(str(e), holder.bind_address)}"
        ) from e
    return holder


def join_group(*, master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str, backend: str, timeout_s: float) -> UpdateGroup:
    """Engine side: join the trainer's group as `rank` (SGLang's rendezvous)."""
    if not 1 < world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size {world_size} must be in 2..{MAX_WORLD_SIZE} (the trainer and the engine ranks)")
    if not 0 < rank < world_size:
        raise ValueError(f"engine rank {rank} must be in 1..{world_size - 1} (rank 0 is the trainer)")
    init_method = f"tcp://{master_address}:{master_port}"
    bind_address = local_address_towards(master_address)
    def form(deadline: float) -> tuple[dist.Store, dist.ProcessGroup]:
        left = timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
        store, _, _ = next(rendezvous(init_method, rank, world_size, timeout=left))
        store.set_timeout(timedelta(seconds=timeout_s))
        return store, _new_group(store, rank=rank, world_size=world_size, group_name=group_name, backend=backend,
                                 timeout_s=max(deadline - time.monotonic(), 1e-3), bind_address=bind_address)

    try:
        store, pg = _bounded(form, timeout_s, f"joining group {group_name!r} at {init_method}",
                             on_abandoned=lambda formed: _destroy_pg(formed[1]))
    except RuntimeError as e:
        raise SyncTimeoutError(f"joining group {group_name!r} at {init_method} failed: {e}"
                               f"{_mesh_hint(str(e), bind_address)}") from e
    return UpdateGroup(group=pg, store=store, rank=rank, world_size=world_size,
                       group_name=group_name, backend=backend, bind_address=bind_address)


def _destroy_pg(pg: dist.ProcessGroup) -> None:
    """A group formed after its caller stopped waiting for it: nobody will use it."""
    try:
        dist.destroy_process_group(pg)
    except (RuntimeError, ValueError, KeyError) as e:
        log.debug("destroying an abandoned group: %s", e)


def _mesh_hint(text: str, bind_address: str) -> str:
    """What to check when gloo's ranks could not connect to each other."""
    if "connectFullMesh" not in text:
        return ""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    here = (f"this rank's gloo device is on interface {interface!r} (GLOO_SOCKET_IFNAME)" if interface
            else f"this rank bound {bind_address}")
    if "remote=[127." in text or "remote=[::1]" in text:
        return (f" ({here}; a peer advertised a loopback address, so its gloo device is bound to loopback: "
                "on that peer's host set GLOO_SOCKET_IFNAME to its interface towards the trainer, or unset it "
                "(weightsync's own engines then bind the address on their route to master_address))")
    return (f" ({here}; every rank must bind an address the others reach: weightsync's ranks bind the one on "
            "their route to master_address, so check that master_address is an address of the trainer the "
            "engines reach; an engine that is not weightsync's, e.g. a stock SGLang, binds what its host name "
            "resolves to unless GLOO_SOCKET_IFNAME names its interface towards the trainer)")
