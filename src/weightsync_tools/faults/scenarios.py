"""The fault scenarios: each injects one fault into real pushes against a `Rig`
and returns a `FaultOutcome` recording what happened.

Engine side: `bad_bucket` (a flipped byte or a truncated bucket, after hashing),
`engine_stalled` (SIGSTOP past timeout_s, mid-push or before a first push:
`engine_stalled_before_push`), `engine_killed` (SIGKILL mid-stream,
then restarted on the same port). Trainer side: `trainer_killed` (a child
trainer SIGKILLed between buckets or mid-wire), `disk_full` (RLIMIT_FSIZE in a
child trainer), `unwritable_root`. Both: `two_trainers` (a collision, older and
equal versions, free races).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from weightsync.errors import EngineError, WeightSyncError
from weightsync.push.sync import WeightSync
from weightsync_tools.faults.inject import (
    CHILD_READY_TIMEOUT_S,
    ChildTrainer,
    FaultyTransport,
    segments_left,
)
from weightsync_tools.faults.rig import (
    BUCKET_BYTES,
    MARGIN_S,
    DictSource,
    Rig,
    Weights,
    digests_of,
    error_bound_s,
    leftover_temp_dirs,
    version_dir_problems,
)

# -- outcomes ----------------------------------------------------------------------------------


@dataclass
class FaultOutcome:
    """What one injected fault did (see the module docstring)."""

    fault: str
    transport: str
    expects_error: bool = True
    """False where the trainer itself is killed (no one is left to get an error)."""
    error_type: str | None = None
    error: str = ""
    status: int | None = None
    """HTTP status carried by an EngineError."""
    seconds: float = 0.0
    """From the faulted push's start until it raised."""
    bound_s: float = 0.0
    hung: bool = False
    """The push did not return within bound_s + MARGIN_S."""
    kept_last_good: bool | None = None
    """After the fault the engine served its last acked version and weights bit-identically
    (None: the engine was restarted, so there was nothing to keep)."""
    generates: bool | None = None
    """After the fault a greedy request completed, tagged with that version."""
    next_push: bool = False
    """The following push succeeded and the engine then served exactly its weights and version."""
    next_push_error: str = ""
    next_push_seconds: float = 0.0
    """How long the next push took (after a killed trainer: includes taking over its session)."""
    next_push_notes: list[str] = field(default_factory=list)
    """The next push's report notes (a dead trainer's session discarded, a wait for one)."""
    conflicts_before_next: int = 0
    """409s the next push met while a dead or stalled trainer's session was open."""
    versions: list[tuple[int, int]] = field(default_factory=list)
    """(engine incarnation, version) as observed, in order."""
    watched_versions: list[int] = field(default_factory=list)
    """Versions a background poller saw during the scenario (two trainers), in order."""
    lost_acked: int = 0
    """Pushes that were acked while the engine then served something else."""
    staged_before_kill: int | None = None
    """Buckets the engine had staged when the trainer was killed."""
    bad_version_dirs: list[str] = field(default_factory=list)
    """Incomplete `v%08d` directories visible to engines (disk)."""
    leftovers: list[str] = field(default_factory=list)
    """A killed trainer's temporary directories and shm segments still there after the
    next push (which removes them)."""
    notes: list[str] = field(default_factory=list)

    @property
    def versions_went_back(self) -> int:
        observed = sum(1 for (i, a), (j, b) in itertools.pairwise(self.versions) if i == j and b < a)
        return observed + sum(1 for a, b in itertools.pairwise(self.watched_versions) if b < a)

    @property
    def survived(self) -> bool:
        error_ok = not self.expects_error or (self.error_type is not None and self.seconds <= self.bound_s)
        return (error_ok and not self.hung and self.kept_last_good is not False and self.generates is not False
                and self.next_push and not self.bad_version_dirs and not self.leftovers
                and self.versions_went_back == 0 and self.lost_acked == 0)

    def summary(self) -> dict[str, Any]:
        return {"fault": self.fault, "transport": self.transport, "survived": self.survived,
                "error": self.error_type, "status": self.status, "seconds": round(self.seconds, 2),
                "hung": self.hung, "kept_last_good": self.kept_last_good, "next_push": self.next_push,
                "versions": [v for _, v in self.versions], "leftovers": self.leftovers, "notes": self.notes}


def _observe(out: FaultOutcome, rig: Rig) -> tuple[int, dict[str, str]]:
    served = rig.served()
    out.versions.append((rig.incarnation, served[0]))
    return served


def _timed_push(out: FaultOutcome, sync: WeightSync, weights: Weights, version: int) -> bool:
    """Push in a thread (so a hang is recorded, not suffered); fill the error fields.
    True if the push succeeded."""
    result: queue.Queue[BaseException | None] = queue.Queue()

    def push() -> None:
        try:
            sync.push(DictSource(weights), version=version)
            result.put(None)
        except BaseException as e:
            result.put(e)

    out.bound_s = out.bound_s or error_bound_s(sync.config.timeout_s)
    started = time.monotonic()
    threading.Thread(target=push, name="weightsync-faulted-push", daemon=True).start()
    try:
        error = result.get(timeout=out.bound_s + MARGIN_S)
    except queue.Empty:
        out.hung, out.seconds = True, time.monotonic() - started
        return False
    out.seconds = time.monotonic() - started
    if error is None:
        return True
    if not isinstance(error, WeightSyncError | OSError):
        raise error
    out.error_type, out.error = type(error).__name__, str(error)
    out.status = error.status if isinstance(error, EngineError) else None
    return False


def _check_kept(out: FaultOutcome, rig: Rig) -> None:
    """The engine is up, serves its last acked version bit-identically and generates with it."""
    if not rig.wait_healthy():
        out.kept_last_good = out.generates = False
        out.notes.append("the engine stopped answering /health")
        return
    out.kept_last_good = _observe(out, rig) == rig.expected()
    out.generates = rig.generates() == rig.version


def _next_push(out: FaultOutcome, rig: Rig, sync: WeightSync, *, conflicts_for_s: float = 0.0) -> None:
    """The trainer's next push must succeed (after waiting out a dead peer's session on
    409 for up to `conflicts_for_s`), and the engine must then serve exactly its weights."""
    version, weights = rig.next_version(), rig.new_weights()
    started = time.monotonic()
    deadline = started + conflicts_for_s
    while True:
        try:
            report = sync.push(DictSource(weights), version=version)
            out.next_push_seconds = time.monotonic() - started
            out.next_push_notes = list(report.notes)
            break
        except EngineError as e:
            if e.status == 409 and time.monotonic() < deadline:
                out.conflicts_before_next += 1
                time.sleep(0.2)  # the open session expires after --session-timeout of idleness
                continue
            out.next_push_error = f"{type(e).__name__}: {e}"
            return
        except (WeightSyncError, OSError) as e:
            out.next_push_error = f"{type(e).__name__}: {e}"
            return
    out.next_push = _observe(out, rig) == (version, digests_of(weights))
    if out.next_push:
        rig.accept(weights, version)
    else:
        out.lost_acked += 1
        out.next_push_error = "the push was acked but the engine serves something else"


# -- scenarios: the engine side fails ----------------------------------------------------------


def engine_killed(rig: Rig, transport: str) -> FaultOutcome:
    """SIGKILL the engine just before bucket 1 goes out; restart it on the same port."""
    out = FaultOutcome("engine killed mid-stream, restarted", transport)
    with rig.sync(FaultyTransport(rig.transport(transport), "kill", rig=rig, at_push=2)) as sync:
        rig.push(sync)
        _observe(out, rig)
        _timed_push(out, sync, rig.new_weights(), rig.next_version())
        out.bad_version_dirs = version_dir_problems(rig.disk_root(transport))
        rig.restart()
        out.kept_last_good = None  # a new process: it serves its checkpoint as v0
        if _observe(out, rig) != rig.expected():
            out.notes.append("the restarted engine does not serve its checkpoint")
            out.generates = False
        else:
            out.generates = rig.generates() == 0
        _next_push(out, rig, sync)
    return out


def engine_stalled(rig: Rig, transport: str) -> FaultOutcome:
    """SIGSTOP the engine just before bucket 1 goes out, for longer than timeout_s."""
    out = FaultOutcome("engine stalled past timeout_s (SIGSTOP)", transport)
    with rig.sync(FaultyTransport(rig.transport(transport), "stop", rig=rig, at_push=2)) as sync:
        rig.push(sync)
        _observe(out, rig)
        try:
            _timed_push(out, sync, rig.new_weights(), rig.next_version())
        finally:
            rig.cont()
        _check_kept(out, rig)
        # The trainer's abort timed out against the stopped engine; its next begin replaces
        # its own unfinished session (same owner), so no 409 on the way.
        _next_push(out, rig, sync)
    return out


def engine_stalled_before_push(rig: Rig, transport: str) -> FaultOutcome:
    """SIGSTOP the engine before a new trainer's first push, for longer than timeout_s:
    even the first calls (the engine's capabilities, joining a group) are bounded by
    the push's timeout_s, not by the engine client's own (60 s by default)."""
    out = FaultOutcome("engine stalled before the first push (SIGSTOP)", transport)
    with rig.sync(transport) as sync:
        _observe(out, rig)
        rig.stop()
        try:
            _timed_push(out, sync, rig.new_weights(), rig.next_version())
        finally:
            rig.cont()
        _check_kept(out, rig)
        _next_push(out, rig, sync)
    return out


def bad_bucket(rig: Rig, transport: str, fault: str) -> FaultOutcome:
    """One bucket flipped ("flip") or cut short ("truncate") after it was hashed."""
    out = FaultOutcome("corrupted bucket (one flipped byte)" if fault == "flip" else "truncated bucket", transport)
    faulty = FaultyTransport(rig.transport(transport), fault, at_push=2)
    with rig.sync(faulty) as sync:
        rig.push(sync)
        _observe(out, rig)
        _timed_push(out, sync, rig.new_weights(), rig.next_version())
        if not faulty.fired.is_set():
            out.notes.append("the fault never fired")
            out.error_type = None
        _check_kept(out, rig)
        out.bad_version_dirs = version_dir_problems(rig.disk_root(transport))
        _next_push(out, rig, sync)
    return out


# -- scenarios: the trainer side fails ---------------------------------------------------------


def _child_spec(rig: Rig, transport: str, weights: Weights, version: int, **extra: Any) -> dict[str, Any]:
    from safetensors.torch import save_file

    path = rig.root / f"trainer-v{version}.safetensors"
    save_file(weights, str(path))
    return {"url": rig.url, "api_key": rig.api_key, "transport": transport, "weights": str(path),
            "order": list(weights), "version": version, "disk_root": str(rig.disk_root(f"child-{transport}-{version}")),
            "bucket_bytes": BUCKET_BYTES, "timeout_s": 60.0, **extra}


def trainer_killed(rig: Rig, transport: str, *, mid_wire: bool = False) -> FaultOutcome:
    """SIGKILL a trainer process after buckets 0 and 1 went out, while it waits to send
    bucket 2 (or, `mid_wire`, while bucket 2 is half on the wire: http half a request
    body, broadcast the engine waiting in the collective)."""
    where = "mid-wire" if mid_wire else "between buckets"
    out = FaultOutcome(f"trainer killed {where}", transport, expects_error=False)
    _observe(out, rig)
    version, weights = rig.next_version(), rig.new_weights()
    fault = "block" if not mid_wire else ("block-body" if transport == "http" else "block-send")
    spec = _child_spec(rig, transport, weights, version, fault=fault, at_bucket=2, timeout_s=rig.timeout_s)
    with ChildTrainer(spec) as child:
        ready = child.wait_for("READY", CHILD_READY_TIMEOUT_S)
        if ready is None:
            out.notes.append(f"the trainer never reached the fault:\n{child.tail()}")
            return out
        if transport == "disk":  # buckets go to files; the engine reads them at commit
            out.staged_before_kill = len(list(Path(spec["disk_root"]).glob(".tmp-*/bucket-*")))
        elif (session := rig.info()["session"]) is not None:
            out.staged_before_kill = len(session["buckets_received"])
        child.kill()
    _check_kept(out, rig)
    root = Path(spec["disk_root"])
    out.bad_version_dirs = version_dir_problems(root)
    if left := leftover_temp_dirs(root) + segments_left(ready):
        out.notes.append(f"the killed trainer left {left} (hidden from engines; the next push removes them)")
    named = json.loads(ready.removeprefix("READY").strip() or "[]")
    if named and not segments_left(ready):  # another process on this host made a segment meanwhile
        out.notes.append(f"the killed trainer's segments {named} were gone before the next push (an orphan "
                         "sweep: any segment made on this host removes those of a dead creator)")
    with rig.sync(transport, disk_root=root) as sync:  # a new trainer, built as the README builds it
        _next_push(out, rig, sync)  # takes over the dead trainer's session: no 409 reaches the user
    out.leftovers = leftover_temp_dirs(root) + segments_left(ready)
    return out


FSIZE_LIMIT = 100_000
"""Per-file size limit for the disk-full trainer: the ~33-64 KB buckets fit, the 128 KB ones do not."""


def disk_full(rig: Rig) -> FaultOutcome:
    """A trainer whose file writes fail (RLIMIT_FSIZE: EFBIG) partway through a version."""
    out = FaultOutcome("disk full mid-stream (file size limit)", "disk")
    _observe(out, rig)
    version = rig.next_version()
    weights = dict(sorted(rig.new_weights().items(), key=lambda kv: kv[1].nbytes))  # small buckets first
    spec = _child_spec(rig, "disk", weights, version, fsize_limit=FSIZE_LIMIT, timeout_s=rig.timeout_s)
    out.bound_s = error_bound_s(rig.timeout_s) + CHILD_READY_TIMEOUT_S
    with ChildTrainer(spec) as child:
        line = child.wait_for("RESULT ", out.bound_s)
    if line is None:
        out.hung = True
        out.notes.append(f"the trainer reported nothing:\n{child.tail()}")
    else:
        result = json.loads(line.removeprefix("RESULT "))
        out.seconds = float(result["seconds"])
        if not result["ok"]:
            out.error_type, out.error = result["error_type"], result["error"]
    _check_kept(out, rig)
    root = Path(spec["disk_root"])
    out.bad_version_dirs = version_dir_problems(root) + [f"left behind: {n}" for n in leftover_temp_dirs(root)]
    with rig.sync("disk", disk_root=root) as sync:
        _next_push(out, rig, sync)
    return out


def unwritable_root(rig: Rig) -> FaultOutcome:
    """The disk root turns into a file between two pushes (root can write anywhere, so
    permissions cannot make it unwritable)."""
    out = FaultOutcome("disk root unwritable (a file now)", "disk")
    root = rig.disk_root("unwritable")
    with rig.sync("disk", disk_root=root) as sync:
        rig.push(sync)
        _observe(out, rig)
        shutil.rmtree(root)
        root.write_bytes(b"not a directory")
        try:
            _timed_push(out, sync, rig.new_weights(), rig.next_version())
            _check_kept(out, rig)
        finally:
            root.unlink()
        _next_push(out, rig, sync)
        out.bad_version_dirs = version_dir_problems(root) + [f"left behind: {n}" for n in leftover_temp_dirs(root)]
    return out


# -- scenarios: two trainers -------------------------------------------------------------------


class _VersionWatch:
    """Polls the engine's version in the background; `versions` in the order seen, the
    first read on entering and the last on leaving (however often the poller ran)."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.versions: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weightsync-version-watch", daemon=True)

    def _read(self) -> None:
        self.versions.append(int(self.rig.info()["weight_version"]))

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(httpx.HTTPError):
                self._read()

    def __enter__(self) -> _VersionWatch:
        self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()


LIVE_LEASE_S = 30.0
"""Trainer A's timeout_s in `two_trainers`: its session counts as live (it cannot be taken)
for this long after A's last request, longer than B is willing to wait (rig.timeout_s)."""


def two_trainers(rig: Rig, transport: str, *, race_rounds: int = 2) -> FaultOutcome:
    """Trainer B pushes while trainer A, alive, is mid-stream (B must get a 409 naming A's
    session, A must win whole); then B pushes an older and an equal version (refused);
    then both race freely."""
    out = FaultOutcome("two trainers at once, then older versions", transport)
    a_transport = FaultyTransport(  # A's first push stops at bucket 1 until released
        rig.transport(transport, disk_root=rig.disk_root(f"{transport}-a"), timeout_s=LIVE_LEASE_S),
        "block", at_bucket=1)
    with _VersionWatch(rig) as watch, rig.sync(a_transport, timeout_s=LIVE_LEASE_S) as a, \
            rig.sync(transport, disk_root=rig.disk_root(f"{transport}-b")) as b:
        _observe(out, rig)
        a_weights, a_version = rig.new_weights(), rig.next_version()
        a_out = FaultOutcome("trainer A", transport)
        thread = threading.Thread(target=_timed_push, args=(a_out, a, a_weights, a_version), daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not a_transport.fired.is_set() and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.01)  # until A holds its session, mid-stream
        if not a_transport.fired.is_set():
            out.notes.append(f"trainer A never reached bucket 1: {a_out.error_type}: {a_out.error}")
            return out
        _timed_push(out, b, rig.new_weights(), rig.next_version())  # B collides with A's session
        a_transport.release.set()
        thread.join()
        if a_out.error_type is not None or a_out.hung:
            out.notes.append(f"trainer A failed: {a_out.error_type}: {a_out.error}")
            return out
        rig.accept(a_weights, a_version)
        out.kept_last_good = _observe(out, rig) == rig.expected()
        for older in (a_version - 1, a_version):  # an older and an equal version
            refused = FaultOutcome("older version", transport)
            if _timed_push(refused, b, rig.new_weights(), older) or refused.status != 409:
                out.kept_last_good = False
                out.notes.append(f"v{older} after v{a_version} was not refused with 409: {refused.error}")
        out.kept_last_good = out.kept_last_good and _observe(out, rig) == rig.expected()
        out.generates = rig.generates() == rig.version
        for _ in range(race_rounds):
            _race(out, rig, a, b)
        _next_push(out, rig, b)
    out.watched_versions = watch.versions
    return out


def _race(out: FaultOutcome, rig: Rig, a: WeightSync, b: WeightSync) -> None:
    """A and B push at the same moment: whoever wins, the engine serves exactly the
    weights of the newest successful push, and every loser got a 409."""
    entries = [(sync, rig.new_weights(), rig.next_version()) for sync in (a, b)]
    barrier = threading.Barrier(2)
    results: list[tuple[bool, FaultOutcome]] = [(False, FaultOutcome("race", out.transport))] * 2

    def run(i: int) -> None:
        sync, weights, version = entries[i]
        barrier.wait()
        record = FaultOutcome("race", out.transport)
        results[i] = (_timed_push(record, sync, weights, version), record)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [(entries[i][2], entries[i][1]) for i, (ok, _) in enumerate(results) if ok]
    losers = [record for ok, record in results if not ok]
    if not winners or any(r.status != 409 for r in losers):
        out.kept_last_good = False
        out.notes.append(f"race: winners {[v for v, _ in winners]}, losers "
                         f"{[(r.error_type, r.status, r.error[:120]) for r in losers]}")
        return
    version, weights = max(winners, key=lambda vw: vw[0])
    rig.accept(weights, version)
    if _observe(out, rig) != rig.expected():
        out.kept_last_good = False
        out.lost_acked += 1
        out.notes.append(f"race: the engine does not serve exactly v{version}, the newest successful push")
