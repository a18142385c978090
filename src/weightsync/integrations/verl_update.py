"""One verl weight update, as each kind of rank runs it (blocking; `integrations.verl` runs these in
a thread beside the worker's event loop).

`send_update` (the sending actor rank) plans, packs, casts, hashes and sends each bucket through a
weightsync transport, then decides from every rollout rank's record; `receive_update` (each rollout
rank) checks every bucket's size and digest before handing tensors to `emit`, all at the verdict
(`hold=True`) or bucket by bucket (`hold=False`); `follow_update` (every other actor rank) iterates
the weights for their gathers and waits for the verdict. Any refusal raises `UpdateRefusedError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.bucketing import unpack
from weightsync.digests import for_device
from weightsync.errors import IntegrityError, ManifestError, WeightSyncError
from weightsync.formats.groups import UpdateGroup
from weightsync.integrations.verl_channel import Channel, VerdictBoard
from weightsync.integrations.verl_plan import StreamPlan
from weightsync.integrity import ack_problems, check_bucket
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta, Manifest
from weightsync.push.pipeline import stream_buckets
from weightsync.reports import Ack, Stages
from weightsync.transports.base import Receiver, Transport

log = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]


class UpdateRefusedError(WeightSyncError):
    """A verl update did not go through: a rollout rank refused a bucket (digest, size,
    version) or was lost, or the sending rank failed. Raised on every actor and rollout
    rank; with `hold_update` (the default) no rollout rank handed verl a tensor of it."""


@dataclass(eq=False)
class Session:
    """What one rank holds between verl's `init_process_group` and `finalize`."""

    rank: int
    """0: the sending actor rank; 1..R: rollout ranks; -1: an actor rank outside the group."""
    timeout_s: float
    """Bound on every collective and wait."""
    group: UpdateGroup | None = None
    """The control group (None on the actor ranks outside it)."""
    board: VerdictBoard | None = None
    """Where the verdicts are posted (rank 0) and awaited (rank -1)."""
    transport: Transport | None = None
    """Rank 0: the trainer side of the transport."""
    receiver: Receiver | None = None
    """Rollout ranks: the engine side of the transport."""
    link: Link | None = None
    """Rollout ranks: the transport session they joined."""
    updates: int = 0
    """Updates begun in this session (the verdict board's key)."""
    broken: bool = False
    """A collective failed: the groups are torn down and the session takes no more updates."""

    @property
    def channel(self) -> Channel:
        if self.group is None or self.broken:
            raise WeightSyncError("this rank's weightsync group is gone (an earlier update failed); verl's next "
                                  "update_weights forms a new one (prepare, build_topology, init_process_group)")
        return Channel(self.group, timeout_s=self.timeout_s)

    def tear_down(self) -> None:
        """Destroy the groups now (a failed collective leaves them unusable, and peers still
        waiting in one fail at once instead of after the timeout); the store stays up for
        the verdict board until `close`."""
        self.broken = True
        if self.transport is not None:
            self.transport.close()
        if self.receiver is not None and self.link is not None:
            self.receiver.leave(self.link)
        if self.group is not None:
            self.group.destroy()

    def close(self) -> None:
        self.tear_down()
        self.group = None
        self.board = None
        self.transport = None
        self.link = None


class _Refused(Exception):
    """A rollout rank refused a bucket: stop sending, and decide on the records."""


class _GroupBroken(Exception):
    """A collective of the update failed (a peer died or timed out): no more messages."""

    def __init__(self, error: WeightSyncError) -> None:
        super().__init__(str(error))
        self.error = error


def send_update(session: Session, weights: Iterator[tuple[str, torch.Tensor]], *, version: int,
                bucket_bytes: int, dtype: torch.dtype | None, max_tensor_bytes: int | None,
                keep_dtype: Sequence[str] = ()) -> dict[str, Any]:
    """The sending actor rank's update; returns verl's sync metrics. `max_tensor_bytes`:
    the largest tensor the transport's slots take (shm sizes them at open), or None;
    `keep_dtype`: name endings of tensors sent in their own dtype (`StreamPlan`)."""
    transport, board = session.transport, session.board
    assert transport is not None and board is not None, "init_process_group first"
    session.updates += 1
    started = time.perf_counter()
    plan = StreamPlan(weights, bucket_bytes=bucket_bytes, dtype=dtype, max_tensor_bytes=max_tensor_bytes,
                      keep_dtype=keep_dtype)
    algorithm = for_device(transport.buffer_device)
    stages = Stages()
    manifest: Manifest | None = None
    reason: str | None = None
    failure: Exception | None = None
    try:
        channel = session.channel
        channel.announce({"kind": "begin", "version": version, "digest_algorithm": algorithm})
        transport.begin(Manifest(version=version, digest_algorithm=algorithm))

        def deliver(bucket: BucketMeta, buffer: torch.Tensor) -> None:
            delivery = transport.deliver(bucket, buffer)
            if not transport.per_bucket_delivery:
                return
            try:
                channel.announce({"kind": "bucket", "bucket": bucket.to_dict(), "delivery": delivery.to_dict()})
                transport.send(bucket, buffer)
                refused = channel.took_bucket(refused=False)
            except WeightSyncError as e:
                raise _GroupBroken(e) from e
            if refused:
                raise _Refused(f"a rollout rank refused bucket {bucket.index}")

        try:
            digests = stream_buckets(plan, plan.buckets(), (), None, slot=transport.slot, deliver=deliver,
                                     stages=stages, drain=True, digest_algorithm=algorithm)
            stages.gather, stages.pack = plan.read_s, max(0.0, stages.pack - plan.read_s)
            manifest = Manifest(version=version, buckets=tuple(plan.planned),
                                digest_algorithm=algorithm).with_digests(digests)
            transport.finish(manifest)
        except _Refused:
            reason = None  # the refusing ranks give their reasons in their records
        except _GroupBroken as e:
            raise e.error from e
        except Exception as e:  # the weights, a cast, the sender's own I/O: the rollout
            # ranks wait on this rank, so they hear why before it is raised (chained below)
            reason, failure = f"the sending actor rank failed: {type(e).__name__}: {e}", e
        plan.drain()  # whatever stopped the stream, the other actor ranks finish their gathers
        if manifest is None:
            transport.discard(version)
            channel.announce({"kind": "abort", "reason": reason or "a rollout rank refused a bucket"})
        else:
            channel.announce({"kind": "end", "manifest": manifest.to_dict()})
        records = channel.gather_records({"rank": 0, "refused": reason, "ack": None})
    except WeightSyncError as e:  # a collective failed: a peer died or timed out
        plan.drain()
        problems = [f"the weightsync group broke, a rank was lost: {e}"]
        board.post(session.updates, {"ok": False, "version": version, "problems": problems})
        session.tear_down()
        raise UpdateRefusedError(_refusal(version, problems)) from e
    problems = _problems(manifest, records)
    verdict = {"ok": not problems, "version": version, "problems": problems}
    try:
        channel.announce({"kind": "verdict", **verdict})
    except WeightSyncError as e:
        problems.append(f"the verdict did not reach every rollout rank: {e}")
        verdict = {"ok": False, "version": version, "problems": problems}
        session.tear_down()
    metrics = _metrics(manifest, stages, time.perf_counter() - started) if manifest is not None else {}
    board.post(session.updates, {**verdict, "metrics": metrics})
    if problems:
        raise UpdateRefusedError(_refusal(version, problems)) from failure
    return metrics


def follow_update(session: Session, weights: Iterator[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """An actor rank outside the group: iterate the weights (every rank's gathers must
    complete), then raise exactly when the sending rank does."""
    board = session.board
    assert board is not None, "init_process_group first"
    session.updates += 1
    for _ in weights:
        pass
    verdict = board.wait(session.updates, timeout_s=session.timeout_s)
    if not verdict.get("ok"):
        raise UpdateRefusedError(_refusal(verdict.get("version"), [str(p) for p in verdict.get("problems", ())]))
    metrics: dict[str, Any] = verdict.get("metrics") or {}
    return metrics


def receive_update(session: Session, *, global_steps: int | None, loaded_version: int, hold: bool,
                   emit: Callable[[NamedTensors], None]) -> int:
    """A rollout rank's update: every bucket checked before any tensor of it is emitted;
    with `hold`, nothing emitted before the verdict. Returns the version."""
    receiver, link = session.receiver, session.link
    assert receiver is not None and link is not None, "init_process_group first"
    try:
        channel = session.channel
        begin = channel.announce(None)
        version, algorithm = int(begin["version"]), str(begin["digest_algorithm"])
        refused: str | None = None
        if global_steps is not None and global_steps != version:
            refused = (f"verl asked this rollout rank for global_steps={global_steps}, the trainer sends version "
                       f"{version}; pass the same global_steps to both")
        elif version <= loaded_version:
            refused = (f"version {version} is not newer than v{loaded_version}, the last one this rollout rank "
                       "took; versions must increase (global_steps)")
        staged: list[tuple[BucketMeta, torch.Tensor | None, str]] = []
        manifest: Manifest | None = None
        while True:
            message = channel.announce(None)
            if message.get("kind") == "bucket":
                bucket = BucketMeta.from_dict(message["bucket"])
                buffer, got, why = _fetch(receiver, link, bucket, Delivery.from_dict(message["delivery"]),
                                          algorithm, expected_index=len(staged))
                refused = refused or why
                anyone_refused = channel.took_bucket(refused=refused is not None)
                if buffer is not None and got is not None and refused is None:
                    if not hold and not anyone_refused:
                        emit(unpack(buffer, bucket))
                        buffer = None
                    staged.append((bucket, buffer, got))
            elif message.get("kind") == "end":
                manifest = Manifest.from_dict(message["manifest"])
                if refused is None and receiver.reads_at_commit:
                    refused = _read_at_commit(receiver, link, manifest, staged)
                elif refused is None:
                    refused = _check_complete(manifest, staged)
                break
            elif message.get("kind") == "abort":
                refused = refused or f"the sending actor rank aborted: {message.get('reason')}"
                break
            else:
                raise ManifestError(f"unexpected control message {message.get('kind')!r}")
        ack = None if refused is not None else Ack(
            engine=f"rollout rank {session.rank}", version=version, digests=tuple(got for _, _, got in staged),
            loaded_names=frozenset(e.hf_name for bucket, _, _ in staged for e in bucket.entries)).to_wire()
        channel.gather_records({"rank": session.rank, "refused": refused, "ack": ack})
        verdict = channel.announce(None)
    except WeightSyncError as e:
        if isinstance(e, (IntegrityError, ManifestError)):
            raise
        session.tear_down()
        kept = ("nothing of this update was handed to verl's server adapter" if hold else
                "the buckets already yielded to verl's server adapter stay loaded (hold_update=False)")
        raise UpdateRefusedError(f"rollout rank {session.rank}: the weightsync group broke mid-update ({e}); "
                                 f"{kept}") from e
    if not verdict.get("ok"):
        raise UpdateRefusedError(_refusal(version, [str(p) for p in verdict.get("problems", ())]))
    for bucket, buffer, _ in staged:  # with hold: every bucket; without: what was not streamed (disk)
        if buffer is not None:
            emit(unpack(buffer, bucket))
    return version


def _fetch(receiver: Receiver, link: Link, bucket: BucketMeta, delivery: Delivery, algorithm: str, *,
           expected_index: int) -> tuple[torch.Tensor | None, str | None, str | None]:
    """(the checked bytes, their digest, None) or (None, None, why it was refused).
    The transport's own failures (a broken group) propagate."""
    into = torch.empty(bucket.nbytes, dtype=torch.uint8)
    data, computed = receiver.fetch_hashed(link, bucket, delivery, into, algorithm)
    try:
        if bucket.index != expected_index:
            raise IntegrityError(f"bucket {bucket.index} arrived where bucket {expected_index} was due")
        return data, check_bucket(bucket, data, algorithm, computed=computed), None
    except IntegrityError as e:
        return None, None, str(e)


def _read_at_commit(receiver: Receiver, link: Link, manifest: Manifest,
                    staged: list[tuple[BucketMeta, torch.Tensor | None, str]]) -> str | None:
    """Read a version the trainer published (disk); each bucket's digest checked by the reader."""
    try:
        for index, buffer in receiver.read(link, manifest):
            bucket = manifest.buckets[index]
            staged.append((bucket, buffer, check_bucket(bucket, buffer, manifest.digest_algorithm)))
    except (IntegrityError, ManifestError, OSError) as e:
        return f"reading version {manifest.version}: {e}"
    return _check_complete(manifest, staged)


def _check_complete(manifest: Manifest, staged: Sequence[tuple[BucketMeta, torch.Tensor | None, str]]) -> str | None:
    """Every bucket of the final manifest staged here, with the manifest's digest."""
    if len(staged) != len(manifest.buckets):
        return f"{len(staged)} bucket(s) arrived, the trainer sent {len(manifest.buckets)}"
    wrong = [b.index for (b, _, got), want in zip(staged, manifest.buckets, strict=True) if got != want.digest]
    return f"bucket(s) {wrong[:8]} differ from the trainer's final digests" if wrong else None


def _problems(manifest: Manifest | None, records: Sequence[dict[str, Any]]) -> list[str]:
    """Every rank's refusal, and every rollout ack that is not the manifest's (version,
    each bucket digest, every name)."""
    problems: list[str] = []
    for record in records:
        who = "the sending actor rank" if record["rank"] == 0 else f"rollout rank {record['rank']}"
        if record.get("refused"):
            problems.append(f"{who} refused: {record['refused']}")
        elif record["rank"] != 0 and manifest is not None:
            problems += ack_problems(manifest, Ack.from_dict(record["ack"], engine=who))
    if manifest is None and not problems:
        problems.append("the update was aborted")
    return problems


def _refusal(version: int | None, problems: Sequence[str]) -> str:
    what = f"weight update v{version}" if version is not None else "the weight update"
    return (f"{what} refused; every rollout rank keeps its last weights (with hold_update=True no tensor of it "
            f"reached verl's server adapter): " + "; ".join(problems[:8]))


def _metrics(manifest: Manifest, stages: Stages, seconds: float) -> dict[str, Any]:
    return {"weightsync/version": manifest.version, "weightsync/bytes": manifest.num_bytes,
            "weightsync/buckets": len(manifest.buckets), "weightsync/tensors": len(manifest.hf_names),
            "weightsync/seconds": round(seconds, 6), "weightsync/verified": 1,
            **{f"weightsync/{k}_s": v for k, v in stages.frozen().to_dict().items()}}
