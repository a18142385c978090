"""The requests and answers of weightsync's own HTTP routes (`/weightsync/*`), typed.

One record per request, used by both sides: the client (`engines.sglang`) builds
it and sends `to_json()` to its `ROUTE`; the server (`server.routes_updates`)
parses the body with `from_json`, which raises `ValueError` naming the field
(an HTTP 400). Answers carry SGLang's `success`/`message` plus the fields below.
SGLang's own routes are SGLang's contract (docs/ENGINES.md) and are not typed here.
The bucket bytes of `/weightsync/bucket` travel in the binary frame of `wire`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from weightsync.errors import UnknownLayoutError
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta, Manifest
from weightsync.transports import parse_link


def _optional(body: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
    """Field `key` of `kind` (bool is no int here), or None when absent."""
    value = body.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise ValueError(f"field {key!r} must be {what}, got {value!r:.80}")
    return value


def _required(body: Mapping[str, Any], key: str, kind: type, what: str) -> Any:
    value = _optional(body, key, kind, what)
    if value is None:
        raise ValueError(f"missing required field {key!r}")
    return value


def _int(body: Mapping[str, Any], key: str) -> int:
    return int(_required(body, key, int, "an integer"))


def _str(body: Mapping[str, Any], key: str) -> str:
    return str(_required(body, key, str, "a string"))


def _opt_int(body: Mapping[str, Any], key: str) -> int | None:
    value: int | None = _optional(body, key, int, "an integer")
    return value


def _opt_str(body: Mapping[str, Any], key: str) -> str | None:
    value: str | None = _optional(body, key, str, "a string")
    return value


@dataclass(frozen=True, kw_only=True)
class BeginRequest:
    """Check a manifest against the served weights and open an update (the dry run).

    Sent whole, or by layout (`by_layout`): every field of the manifest but its buckets,
    which the engine takes from the layout it remembers by `Manifest.layout_digest` (the
    one it named in its answer to an earlier begin: "layout"), with the digests sent here.
    An engine that does not remember it answers 409 with "unknown_layout" (raised here as
    `UnknownLayoutError`), and the trainer sends the manifest whole."""

    ROUTE: ClassVar[str] = "/weightsync/begin"
    manifest: Manifest
    """What the update will send, without digests."""
    by_layout: bool = False
    """Send the buckets as `manifest.layout_digest`, not their entries."""

    def to_json(self) -> dict[str, Any]:
        if self.by_layout:
            return {"manifest": self.manifest.to_dict(buckets=False), "layout": self.manifest.layout_digest,
                    "digests": list(self.manifest.digests)}
        return {"manifest": self.manifest.to_dict()}

    def to_json_text(self) -> str:
        """`to_json()` as JSON text, the manifest's part from `Manifest.to_json` (no dict per tensor)."""
        if self.by_layout:
            return json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True)
        return f'{{"manifest":{self.manifest.to_json()}}}'

    @classmethod
    def from_json(cls, body: Mapping[str, Any], *, known: Manifest | None = None,
                  layouts: Callable[[str], Sequence[BucketMeta] | None] | None = None) -> BeginRequest:
        """`known`: the manifest the engine began last, whose entries are reused where the same
        (`Manifest.from_dict`). `layouts`: the buckets of a layout the engine remembers, by
        digest (None where it does not); without it, a begin by layout is refused too."""
        manifest = body.get("manifest")
        if not isinstance(manifest, Mapping):
            raise ValueError("field 'manifest' must be a JSON object (a weightsync manifest)")
        layout = body.get("layout")
        if layout is None:
            return cls(manifest=Manifest.from_dict(manifest, known=known))
        if not isinstance(layout, str):
            raise ValueError(f"field 'layout' must be a layout digest (a hex string), got {layout!r:.80}")
        buckets = layouts(layout) if layouts is not None else None
        if buckets is None:
            raise UnknownLayoutError(layout)
        digests = body.get("digests")
        if not (isinstance(digests, list) and len(digests) == len(buckets)
                and all(d is None or isinstance(d, str) for d in digests)):
            raise ValueError(f"field 'digests' must list a hex digest or null for each of the layout's "
                             f"{len(buckets)} bucket(s)")
        layout_buckets = [b.with_digest(d) for b, d in zip(buckets, digests, strict=True)]
        return cls(manifest=Manifest.from_dict(manifest, layout=layout_buckets), by_layout=True)


@dataclass(frozen=True, kw_only=True)
class ShmBucketRequest:
    """Take bucket `index` of update `version` from slot `slot` of a shared-memory segment."""

    ROUTE: ClassVar[str] = "/weightsync/shm_bucket"
    version: int
    index: int
    digest: str | None
    """The sender's digest of the bucket (checked against the one computed on receipt)."""
    shm_name: str
    slot_bytes: int
    num_slots: int
    slot: int

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "index": self.index, "digest": self.digest, "shm_name": self.shm_name,
                "slot_bytes": self.slot_bytes, "num_slots": self.num_slots, "slot": self.slot}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ShmBucketRequest:
        request = cls(version=_int(body, "version"), index=_int(body, "index"), digest=_opt_str(body, "digest"),
                      shm_name=_str(body, "shm_name"), slot_bytes=_int(body, "slot_bytes"),
                      num_slots=_int(body, "num_slots"), slot=_int(body, "slot"))
        if request.slot_bytes <= 0 or request.num_slots <= 0:
            raise ValueError("slot_bytes and num_slots must be positive")
        if not 0 <= request.slot < request.num_slots:
            raise ValueError(f"slot {request.slot} is not one of the segment's {request.num_slots} slots")
        return request


@dataclass(frozen=True, kw_only=True)
class ReceiveRequest:
    """Take bucket `index` of update `version` through the engine end of the link's
    transport (`transports.make_receiver`), which joins the link's session at the
    first bucket and fetches the bytes the delivery points at (shm: a slot)."""

    ROUTE: ClassVar[str] = "/weightsync/receive"
    version: int
    index: int
    digest: str | None
    """The sender's digest of the bucket (checked against the one computed on receipt)."""
    link: Link
    delivery: Delivery

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "index": self.index, "digest": self.digest,
                "link": self.link.to_dict(), "delivery": self.delivery.to_dict()}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ReceiveRequest:
        return cls(version=_int(body, "version"), index=_int(body, "index"), digest=_opt_str(body, "digest"),
                   link=parse_link(_record(body, "link")), delivery=Delivery.from_dict(_record(body, "delivery")))


def _record(body: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """Field `key`: a JSON object naming a transport, its other values scalars."""
    value = body.get(key)
    if not (isinstance(value, Mapping) and isinstance(value.get("transport"), str)
            and all(v is None or isinstance(v, str | int | float) for v in value.values())):
        raise ValueError(f"{key!r} must be a JSON object with a 'transport' name and scalar fields")
    return value


@dataclass(frozen=True, kw_only=True)
class CommitRequest:
    """Apply the open update `version`; the answer carries the ack (`Ack.to_wire()`)."""

    ROUTE: ClassVar[str] = "/weightsync/commit"
    version: int
    pause: str | None = None
    """An SGLang pause mode to hold generation in for the commit (the engine resumes
    when the commit ends, failed or not), so a push needs no pause and resume round
    trips; None: no pause, or the trainer paused the engine itself."""
    names_digest: bool = False
    """The trainer checks an ack whose loaded names come as their digest (`Ack.names_digest`):
    the engine sends it instead of the list where it loaded exactly the manifest's names.
    False (what trainers before it send): the list."""

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"version": self.version}
        if self.pause is not None:
            body["pause"] = self.pause
        if self.names_digest:
            body["names_digest"] = True
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> CommitRequest:
        names_digest = body.get("names_digest", False)
        if not isinstance(names_digest, bool):
            raise ValueError(f"field 'names_digest' must be a boolean, got {names_digest!r:.80}")
        return cls(version=_int(body, "version"), pause=_opt_str(body, "pause"), names_digest=names_digest)


@dataclass(frozen=True, kw_only=True)
class AbortRequest:
    """Drop the open update (of `version`, if given), unless another trainer owns it."""

    ROUTE: ClassVar[str] = "/weightsync/abort"
    version: int | None = None
    owner: str | None = None
    """The aborting trainer (`owners.session_owner()`); another owner's update is kept."""

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "owner": self.owner}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> AbortRequest:
        return cls(version=_opt_int(body, "version"), owner=_opt_str(body, "owner"))


@dataclass(frozen=True, kw_only=True)
class RollbackRequest:
    """Undo the commit of `version` (the weights, version and adapters served before it are
    served again), while no update began since; a no-op where `version` is not served."""

    ROUTE: ClassVar[str] = "/weightsync/rollback"
    version: int
    owner: str | None = None
    """The trainer that committed it; another trainer's commit is not undone."""

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "owner": self.owner}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RollbackRequest:
        return cls(version=_int(body, "version"), owner=_opt_str(body, "owner"))


@dataclass(frozen=True, kw_only=True)
class DigestsRequest:
    """Digests of the served weights (all of them, or the named ones)."""

    ROUTE: ClassVar[str] = "/weightsync/digests"
    names: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"names": None if self.names is None else list(self.names)}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> DigestsRequest:
        names = body.get("names")
        if names is None:
            return cls()
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("'names' must be a list of weight names or null")
        return cls(names=tuple(names))


@dataclass(frozen=True, kw_only=True)
class GroupRelayRequest:
    """Relay the open update `version` in weight-update group `group_name` (a relayed
    broadcast push): take each of its buckets from rank `source_rank`, check its digest,
    stage it, and send it on to rank `forward_rank` (None: this engine is the last). The
    engine answers at once; the trainer learns the outcome from `/weightsync/info`."""

    ROUTE: ClassVar[str] = "/weightsync/relay"
    version: int
    group_name: str
    source_rank: int
    source_label: str
    """How errors name the sender (the trainer, or the engine before this one)."""
    forward_rank: int | None = None
    forward_label: str | None = None
    """How errors name the next engine (its label)."""

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "group_name": self.group_name, "source_rank": self.source_rank,
                "source_label": self.source_label, "forward_rank": self.forward_rank,
                "forward_label": self.forward_label}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> GroupRelayRequest:
        forward_rank = _opt_int(body, "forward_rank")
        forward_label = _opt_str(body, "forward_label")
        if (forward_rank is None) != (forward_label is None):
            raise ValueError("'forward_rank' and 'forward_label' go together (both, or neither for the last engine)")
        return cls(version=_int(body, "version"), group_name=_str(body, "group_name"),
                   source_rank=_int(body, "source_rank"), source_label=_str(body, "source_label"),
                   forward_rank=forward_rank, forward_label=forward_label)


WeightsyncRequest = (BeginRequest | ReceiveRequest | ShmBucketRequest | CommitRequest | AbortRequest | RollbackRequest
                     | DigestsRequest | GroupRelayRequest)
"""Any request of weightsync's own POST routes: `ROUTE` and `to_json()`."""

INFO_ROUTE = "/weightsync/info"
"""GET: the engine's state; "capabilities" holds `EngineCapabilities.to_dict()`."""
BUCKET_ROUTE = "/weightsync/bucket"
"""POST: one bucket in the binary frame of `wire` (header: version, index, nbytes, digest)."""
