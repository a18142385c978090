"""Calls across engine replicas: each round of a push's engine calls (the handshake, connect,
pause, begin, receive, ready, commit, resume, and the cleanup rounds after a failure) goes to
every engine at once, bounded by the push's `timeout_s`. This module decides where each engine
pauses and the order of the commits, and keeps what the push has done with each engine in its
`EngineUpdate`; which engines take a bucket is the push's fan-out's (`weightsync.push.fanout`).
The rounds: docs/ARCHITECTURE.md; their bounds and the cleanup backlog: docs/GUARANTEES.md (1).
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any, TypeVar

from weightsync.engines.base import (
    AdapterUnloader,
    DigestReader,
    Engine,
    EngineCapabilities,
    EngineUpdate,
    Link,
    PausePolicy,
    Rollbacker,
    verbs_of,
)
from weightsync.errors import EngineError, IntegrityError, SyncTimeoutError, WeightSyncError
from weightsync.formats.shares import Share
from weightsync.hosts import check_reachable
from weightsync.integrity import ack_problems, digest_checked
from weightsync.links import Delivery
from weightsync.manifest import BucketMeta, Manifest
from weightsync.naming import ExpertLayout
from weightsync.push.cleanup import Backlog
from weightsync.push.fanout import FanOut
from weightsync.reports import Ack
from weightsync.transports import receiver_class, same_host_only
from weightsync.transports.base import Transport

log = logging.getLogger(__name__)
T = TypeVar("T")


class Replicas:
    """The engines of one `WeightSync`, called together.

    `timeout_s` bounds every round of a push; `cleanup_timeout_s` the cleanup rounds of a
    failed push together (`failing`) and each cleanup call that runs in the background.
    Pushes go over `transport` in `mode`, which carries a LoRA adapter where `sends_adapter`,
    and reach the engines as `fan_out` routes them.
    """

    def __init__(self, engines: Sequence[Engine], *, timeout_s: float, cleanup_timeout_s: float,
                 transport: str, mode: str, sends_adapter: bool, fan_out: FanOut) -> None:
        self.engines = list(engines)
        self.transport, self.mode, self.sends_adapter = transport, mode, sends_adapter
        self.fan_out = fan_out
        """How a bucket or a share reaches the engines (`weightsync.push.fanout`)."""
        self.timeout_s = timeout_s
        self.cleanup_timeout_s = cleanup_timeout_s
        # per engine: a call of the push and a background cleanup task (which waits for that call)
        self.pool = ThreadPoolExecutor(max_workers=2 * len(self.engines) + 2, thread_name_prefix="weightsync")
        self.backlog = Backlog(self.pool, settle_s=cleanup_timeout_s)
        """Engines that timed out in this push and the cleanup they are owed."""
        self.links: list[Link] | None = None
        """Each engine's link in the transport session it joined (None: no session)."""
        self.updates: list[EngineUpdate] = []
        """Each engine's update in the push under way (`open_updates`), handed to its calls."""
        self._caps: list[EngineCapabilities] | None = None
        self._cleanup_by: float | None = None
        """While a failed push cleans up: when every cleanup round must have answered."""

    # -- what the engines declare --------------------------------------------

    def handshake(self) -> list[EngineCapabilities]:
        """The session's one round of questions: every engine's declared capabilities, asked
        here unless this transport session asked them already (the first push of a session,
        or a close that needs them after the session was left); an engine that declares it
        cannot take the transport in this mode, or the fan-out, is refused, naming it."""
        if self._caps is None:
            timeout_s = self.timeout_s
            deadline = time.monotonic() + timeout_s
            asked = [self.pool.submit(e.capabilities, timeout_s) for e in self.engines]
            caps = [self.wait(future, f"{e.label}: asking its capabilities", index=i, deadline=deadline)
                    for i, (e, future) in enumerate(zip(self.engines, asked, strict=True))]
            for engine, c in zip(self.engines, caps, strict=True):
                declared = c.lora_transports if self.sends_adapter else c.transports
                if declared and self.transport not in declared:
                    raise EngineError(engine.label, f"this engine takes mode={self.mode!r} over "
                                      f"{sorted(declared)}, not transport={self.transport!r}")
                self.fan_out.refuse_engine(engine.label, c)
            self._caps = caps
        return self._caps

    def capabilities(self) -> list[EngineCapabilities]:
        """What every engine declared at this session's `handshake` (asks nothing)."""
        assert self._caps is not None, "handshake() first"
        return self._caps

    def by_label(self) -> dict[str, EngineCapabilities]:
        """Engine label -> its capabilities (the dtype it serves, the tensors it keeps in another)."""
        return dict(zip((e.label for e in self.engines), self.capabilities(), strict=True))

    def expert_layouts(self) -> dict[str, ExpertLayout]:
        """Engine label -> the layout it loads Mixture-of-Experts layers in (`EngineCapabilities.expert_layout`)."""
        return {e.label: c.expert_layout for e, c in zip(self.engines, self.capabilities(), strict=True)}

    @property
    def asked(self) -> bool:
        """This transport session's handshake was made (its capabilities are known)."""
        return self._caps is not None

    def rollbackers(self) -> list[Rollbacker | None]:
        """Per engine: where it undoes its last commit (`engines.base.verbs_of`), where it declares it
        can (`EngineCapabilities.rolls_back`), else None."""
        verbs = [verbs_of(e, self.timeout_s) if c.rolls_back else None
                 for e, c in zip(self.engines, self.capabilities(), strict=True)]
        return [v if isinstance(v, Rollbacker) else None for v in verbs]

    def unloaders(self) -> list[AdapterUnloader]:
        """The engines that unload LoRA adapters by name (`EngineCapabilities.unloads_adapters`)."""
        return [e for e, c in zip(self.engines, self.capabilities(), strict=True)
                if c.unloads_adapters and isinstance(e, AdapterUnloader)]

    def refuse_unfit(self, transport: Transport) -> None:
        """When the `WeightSync` is built: refuse, naming what works, an engine that cannot take
        `transport` in this mode or take part in the fan-out, or that is on another host where the
        transport reaches one host only (shm) or engines reach the trainer at a loopback address
        (broadcast)."""
        if not self.engines:
            raise ValueError("WeightSync needs at least one engine")
        for e in self.engines:
            allowed = self._allowed(e)
            if self.transport not in allowed:
                note = e.transports_note
                raise ValueError(f"{e.label} cannot take mode={self.mode!r} over transport={self.transport!r}; "
                                 f"it supports {sorted(allowed)}" + (f": {note}" if note else ""))
        self.fan_out.refuse_unfit(self, transport)
        check_reachable(
            [(e.label, e.url, [t for t in sorted(self._allowed(e)) if not same_host_only(t)]) for e in self.engines],
            transport=self.transport, same_host_only=transport.same_host_only,
            trainer_address=transport.trainer_address)

    def _allowed(self, engine: Engine) -> frozenset[str]:
        return engine.lora_transports if self.sends_adapter else engine.transports

    # -- the session ---------------------------------------------------------

    def join(self, transport: Transport, *, max_bucket_bytes: int, leased_buckets: int = 0) -> None:
        """Have every engine in `transport`'s session (kept while the transport keeps it: the
        same links), all joined within timeout_s; a session that cannot form is ended."""
        links = transport.open([c.num_ranks for c in self.capabilities()], max_bucket_bytes=max_bucket_bytes,
                               leased_buckets=leased_buckets)
        if self.links is not None and links == self.links:
            return  # the same session: engines stay connected
        if self.links is not None:
            self.disconnect(self.links)  # e.g. a new group or a bigger segment replaces the old
        try:
            self.connect(links, establish=transport.establish, what=f"joining the {self.transport} session")
        except BaseException:
            self.leave(transport, links)
            raise

    def leave(self, transport: Transport | None, links: Sequence[Link] | None = None) -> None:
        """End the session (`links`, by default the one joined): the transport closes, every
        engine leaves, and the next session asks every engine's capabilities again (an engine
        may have been restarted)."""
        links = self.links if links is None else links
        if transport is not None:
            transport.close()
        if links is not None:
            self.disconnect(links)
        self.forget_capabilities()

    def connect(self, links: Sequence[Link], *, establish: Callable[[], None], what: str) -> None:
        """Every engine joins the session `links` describe while `establish` runs here (a
        broadcast group forms), all within timeout_s. On a failure, the joins still under
        way are owed their leaving (the caller ends the session)."""
        connects = [self.pool.submit(e.connect, link) for e, link in zip(self.engines, links, strict=True)]
        deadline = time.monotonic() + self.timeout_s  # forming a group included
        try:
            establish()
            for i, future in enumerate(connects):
                self.wait(future, f"{self.engines[i].label}: {what}", index=i, deadline=deadline)
        except BaseException:
            for i, future in enumerate(connects):
                if not future.done():  # it leaves once its join has answered
                    self.backlog.mark(i, self.engines[i].label, future)
            raise
        self.links = list(links)

    def disconnect(self, links: Sequence[Link]) -> None:
        """Every engine leaves the session at once; the links carry the cleanup bound."""
        def leave(engine: Engine, link: Link) -> None:
            engine.disconnect(replace(link, timeout_s=self.cleanup_timeout_s))

        self.cleanup(lambda e, i: leave(e, links[i]), "leaving the session")
        self.links = None

    def forget_capabilities(self) -> None:
        self._caps = None

    # -- the rounds of a push --------------------------------------------------

    def open_updates(self, manifest: Manifest, policy: PausePolicy) -> None:
        """A push of `manifest` under `policy` starts, in the session joined: a fresh
        `EngineUpdate` per engine, which every call of the push is handed."""
        assert self.links is not None, "join() first"
        self.updates = [EngineUpdate(version=manifest.version, link=link, owner=manifest.owner, policy=policy)
                        for link in self.links]

    def pause(self, policy: PausePolicy, *, streamed: bool = False) -> None:
        """Pause every engine per `policy`. Once the update is begun and `streamed`, an engine
        that stages it and can pause for the commit alone (`EngineCapabilities.pauses_at_commit`,
        over a transport whose bytes are in before the commit) is not called: its commit
        request will carry the pause (`EngineUpdate.pause_at_commit`), which saves two round
        trips. The caller resumes every engine even when this raises: a pause that failed may
        have taken effect on some engine, or still take effect (vLLM 0.32 applies a `/pause`
        it read after the client gave up on the answer), and an engine left paused would hold
        every request forever."""
        if policy is PausePolicy.NONE:
            return
        at_commit = streamed and not receiver_class(self.transport).reads_at_commit
        calling = []
        for i, (update, caps) in enumerate(zip(self.updates, self.capabilities(), strict=True)):
            if at_commit and caps.pauses_at_commit and caps.stages_updates:
                update.pause_at_commit = True
            else:
                calling.append(i)
        self.all(lambda e, update: self._pause(e, update), "pause", among=calling)

    def _pause(self, engine: Engine, update: EngineUpdate) -> None:
        """Pause `engine` now, naming the pause (the id is kept before the call: a pause that
        times out may still land, and the resume cancels it by that id)."""
        update.pause_at_commit = False
        update.pause_id = secrets.token_hex(8)
        engine.pause(update.policy, pause_id=update.pause_id, timeout_s=self.timeout_s)

    def resume(self, policy: PausePolicy, timeout_s: float) -> None:
        """Resume every engine the push paused, or tried to, except those whose commit did."""
        if policy is PausePolicy.NONE:
            return
        updates = self.updates  # a call left to the backlog runs after this push

        def resume(engine: Engine, i: int) -> None:
            if not updates[i].resumed_by_commit:
                engine.resume(pause_id=updates[i].pause_id, timeout_s=timeout_s)

        self.cleanup(resume, "resuming generation", timeout_s=timeout_s)

    def begin(self, manifest: Manifest) -> list[str]:
        """Every engine's dry run. An engine busy with another live trainer's session says
        when that session would expire: ask again until it ends or expires, within
        timeout_s. Returns notes for the report (a dead trainer's session discarded)."""
        started = time.monotonic()
        deadline = started + self.timeout_s
        backoff, busy = 0.05, 0
        while True:
            try:
                # each attempt has timeout_s of its own: an engine that answers 409 is alive
                answers = self.all(lambda e, update: e.begin(manifest, update), "begin")
            except EngineError as e:
                expires = e.retry_after_s
                if e.status != 409 or expires is None or time.monotonic() + expires > deadline:
                    raise
                log.info("%s", e)
                busy += 1
                # ask again soon (the other push may just finish) and at the latest when it expires
                time.sleep(min(backoff, expires + 0.05))
                backoff = min(2 * backoff, 1.0)
                continue
            notes = [f"{e.label}: {a}" for e, a in zip(self.engines, answers, strict=True) if a]
            notes += self.fan_out.notes(self.engines)
            if busy:
                notes.append(f"waited {time.monotonic() - started:.1f}s ({busy} busy answer(s)) for another "
                             "trainer's update session to end or expire")
            return notes

    def start(self, manifest: Manifest) -> None:
        """After begin: what the fan-out starts before any bucket (a relay in a group: every hop)."""
        self.fan_out.start(self, manifest)

    def receive(self, bucket: BucketMeta, delivery: Delivery, send: Callable[[], None]) -> None:
        """The engines take `bucket` while `send` (the transport's side of it) runs here,
        all within timeout_s, as the fan-out routes it (relayed: the first engine takes it
        and forwards it along the others; `ready` finds where it stopped)."""
        self.fan_out.deliver(self, bucket, delivery, send)

    def receive_share(self, share: Share) -> None:
        """The engines take this trainer rank's `share` of a bucket, within timeout_s, as the fan-out routes it."""
        self.fan_out.deliver_share(self, share)

    def while_sending(self, calls: Sequence[tuple[int, Callable[[], object]]], send: Callable[[], None],
                      what: str) -> None:
        """Each `(index, call)` on engine `index` at once while `send` runs here, all
        answered within timeout_s; where `send` times out, the calls still under way are
        the stalled engines' (they did not take it in time either)."""
        deadline = time.monotonic() + self.timeout_s  # the collective is bounded by timeout_s too
        futures = [(i, self.pool.submit(call)) for i, call in calls]
        try:
            send()
        except SyncTimeoutError:
            for i, future in futures:
                if not future.done():
                    self.backlog.mark(i, self.engines[i].label, future)
            raise
        for i, future in futures:
            self.wait(future, f"{self.engines[i].label}: {what}", index=i, deadline=deadline)

    def ready(self, manifest: Manifest) -> None:
        """Once every engine holds every bucket (the fan-out waits, relayed, until each says so
        or one says where the relay broke): with several replicas, find an engine that cannot
        commit before any does."""
        self.fan_out.wait_delivered(self, manifest)
        if len(self.engines) > 1:
            self.all(lambda e, update: self._ready(e, manifest, update), "checking it can commit")

    def _ready(self, engine: Engine, manifest: Manifest, update: EngineUpdate) -> None:
        """`engine` can still commit; where its commit would have paused it alone, it pauses
        now: with several replicas no request may run on a commit that is then rolled back."""
        engine.ready(manifest, update)
        update.checked = True
        if update.pause_at_commit:
            self._pause(engine, update)

    def commit(self, manifest: Manifest) -> list[Ack]:
        """Commit on every engine and check every ack against what was sent (where it carries
        digests: `integrity.digest_checked`). Engines that can undo a commit
        (`EngineCapabilities.rolls_back`) commit first, all at once; the others only once
        every one of those acked what was sent. On a failure the caller rolls back the
        engines that committed (`roll_back`), so a push is all or nothing across replicas
        when at most one engine cannot undo its commit."""
        undoable = [r is not None for r in self.rollbackers()]
        acks: dict[int, Ack] = {}
        for first in (True, False):
            among = [i for i, u in enumerate(undoable) if u is first]
            if not among:
                continue
            # every answer is awaited: a rollback must not overtake a commit still under way
            acks.update(zip(among, self.all(lambda e, update: self._commit(e, manifest, update), "commit",
                                            among=among, settle=True), strict=True))
            problems = [p for i in among if digest_checked(acks[i]) for p in ack_problems(manifest, acks[i])]
            if problems:
                raise IntegrityError("engines acked something other than what was sent: " + "; ".join(problems))
        return [acks[i] for i in range(len(self.engines))]

    @staticmethod
    def _commit(engine: Engine, manifest: Manifest, update: EngineUpdate) -> Ack:
        """`engine` commits; where its commit carried the pause, the engine resumed once it
        answered (an error with an HTTP status is an answer), and is not resumed again."""
        try:
            ack = engine.commit(manifest, update)
        except EngineError as e:
            update.resumed_by_commit = update.pause_at_commit and e.status is not None
            raise
        update.resumed_by_commit = update.pause_at_commit
        return ack

    def ask_digest_readers(self, call: Callable[[DigestReader], T], what: str) -> list[T]:
        """`call` on every engine that reports digests of its served weights (`DigestReader`), at once."""
        verbs = [verbs_of(e, self.timeout_s) if c.reads_digests else None
                 for e, c in zip(self.engines, self.capabilities(), strict=True)]
        readers = [(i, v) for i, v in enumerate(verbs) if isinstance(v, DigestReader)]
        deadline = time.monotonic() + self.timeout_s
        futures = [(i, e, self.pool.submit(call, e)) for i, e in readers]
        return [self.wait(f, f"{self.engines[i].label}: {what}", index=i, deadline=deadline) for i, _, f in futures]

    # -- after a failure -----------------------------------------------------

    def failing(self) -> None:
        """A push failed: the cleanup rounds from now on share one bound, until `settled`."""
        self._cleanup_by = time.monotonic() + self.cleanup_timeout_s

    def settled(self) -> None:
        self._cleanup_by = None

    def abort(self, version: int) -> None:
        cleanup_s = self.cleanup_timeout_s
        updates = self.updates  # a call left to the backlog runs after this push
        self.cleanup(lambda e, i: e.abort(updates[i], timeout_s=cleanup_s), f"abort of v{version}")

    def roll_back(self, version: int, error: BaseException) -> None:
        """After a failed commit round: undo `version` on every engine that committed it and
        can (a no-op where it did not commit); says what it did in a note on `error`. An
        engine that timed out in this push is rolled back in the background."""
        cleanup_s = self.cleanup_timeout_s
        deadline = self._cleanup_deadline(cleanup_s)
        futures = []
        for i, engine in enumerate(self.rollbackers()):
            if engine is None:
                continue
            future = self._cleanup_call(i, f"rollback of v{version}",
                                        functools.partial(engine.rollback, version, owner=self.updates[i].owner,
                                                          timeout_s=cleanup_s))
            if future is None:
                error.add_note(f"{engine.label} did not answer: its rollback of v{version} goes out in the "
                               f"background (if its commit landed, it serves v{version} until then)")
            else:
                futures.append((i, engine, future))
        undone = []
        for i, engine, future in futures:
            try:
                if self.wait(future, f"{engine.label}: rollback of v{version}", index=i, deadline=deadline,
                             limit_s=cleanup_s):
                    undone.append(engine.label)
            except WeightSyncError as e:
                log.warning("%s", e)
                error.add_note(f"{engine.label} was not rolled back (if its commit landed, it serves v{version}): {e}")
        if undone:
            log.warning("v%d rolled back on %s", version, ", ".join(undone))
            error.add_note(f"v{version} had committed on {', '.join(undone)}: rolled back to the last version")

    # -- bounded calls -------------------------------------------------------

    def all(self, call: Callable[[Any, EngineUpdate], T], what: str, *, among: Sequence[int] | None = None,
            settle: bool = False, deadline: float | None = None) -> list[T]:
        """`call(engine, update)` (its `EngineUpdate` in the push under way) on every engine (those
        at the indices `among`) at once, all answered by `deadline` (default: timeout_s from now);
        the first error wins, raised at once or, with `settle`, once every call answered or timed
        out."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        chosen = range(len(self.engines)) if among is None else among
        futures = [(i, self.pool.submit(call, self.engines[i], self.updates[i])) for i in chosen]
        results: list[T] = []
        first: BaseException | None = None
        for i, future in futures:
            try:
                results.append(self.wait(future, f"{self.engines[i].label}: {what}", index=i, deadline=deadline))
            except BaseException as e:
                if not settle:
                    raise
                first = first or e
        if first is not None:
            raise first
        return results

    def cleanup(self, call: Callable[[Any, int], object], what: str, *, timeout_s: float | None = None) -> None:
        """`call(engine, index)` on every engine at once, answered within `timeout_s` (the
        cleanup bound by default; while a failed push cleans up, what is left of its shared
        bound); errors are logged, never raised. An engine that timed out in this push is not
        waited on: the call joins its backlog (`weightsync.push.cleanup`), as does every later one."""
        limit_s = self.cleanup_timeout_s if timeout_s is None else timeout_s
        deadline = self._cleanup_deadline(limit_s)
        futures = [(i, self._cleanup_call(i, what, functools.partial(call, engine, i)))
                   for i, engine in enumerate(self.engines)]
        for i, future in futures:
            if future is None:
                continue
            try:
                self.wait(future, f"{self.engines[i].label}: {what}", index=i, deadline=deadline, limit_s=limit_s)
            except WeightSyncError as e:
                log.warning("%s", e)

    def wait(self, future: Future[T], what: str, *, index: int, deadline: float, limit_s: float | None = None) -> T:
        """The answer of engine `index`'s call `future` by `deadline` (whichever fires first:
        this or the engine client's own timeout). A call that times out marks the engine as
        stalled for the rest of the push; `limit_s` is the bound the error names."""
        limit_s = self.timeout_s if limit_s is None else limit_s
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self.backlog.mark(index, self.engines[index].label, future)
            raise SyncTimeoutError(f"{what}: no answer within {limit_s:.0f}s") from None
        except SyncTimeoutError:
            self.backlog.mark(index, self.engines[index].label)
            raise

    def _cleanup_call(self, index: int, what: str, call: Callable[[], object]) -> Future[Any] | None:
        """Start a cleanup call to engine `index` now, or, where it timed out in this push,
        add it to its backlog (None): it is not waited on twice."""
        if self.backlog.stalled(index):
            self.backlog.owe(index, what, call)
            return None
        return self.pool.submit(call)

    def _cleanup_deadline(self, limit_s: float) -> float:
        """When a cleanup round must have answered: the shared bound of a failed push's
        cleanup while it runs, else `limit_s` from now."""
        return self._cleanup_by if self._cleanup_by is not None else time.monotonic() + limit_s
