"""What comes back from an update: each engine's `Ack` once it committed, and the
trainer's `SyncReport` of one `WeightSync.push` with its per-stage `StageSeconds`.

Frozen dataclasses with a JSON form (`Ack.to_wire` is what an engine sends in its
commit answer, docs/PROTOCOL.md). No I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Ack:
    """What an engine reports after committing an update."""

    engine: str
    """Which engine acked (its URL or label)."""
    version: int
    """The weight version the engine now serves."""
    digests: tuple[str | None, ...] = ()
    """Per-bucket digests the engine computed on receipt, in manifest order; None where
    the engine cannot report one (a stock SGLang)."""
    loaded_names: frozenset[str] = frozenset()
    """Names the engine loaded (its checkpoint names); empty in an ack that came as
    `names_digest` alone."""
    names_digest: str | None = None
    """The digest of the loaded names (`integrity.names_digest`), set by an engine whose
    loaded names are exactly the manifest's; on the wire it replaces the list where the
    trainer asked for it (`to_wire(names_digest=True)`), and the trainer compares it with
    the digest of the names it sent. None: the list is the ack's only word on coverage."""
    tensor_digests: Mapping[str, str] = field(default_factory=dict)
    """"sparse" updates: name -> digest of every touched tensor WHOLE, as the engine holds
    it after applying (the manifest's digest algorithm); empty otherwise."""
    held_slots: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """shm segment name -> the slots of it the engine serves weights from (it adopted
    them instead of copying their bytes out): the trainer writes none of them until an
    ack no longer names them. Empty for an engine that copies."""
    peak_extra_bytes: int | None = None
    """The engine's peak resident bytes during this update beyond its resident set at begin
    (`process_memory.MemoryMark`), the processes that received it summed (each vLLM worker);
    None where the engine did not measure it (no /proc, an older engine, a stock SGLang)."""
    kept_bytes: int | None = None
    """The engine's resident bytes after the commit minus those at begin, summed as
    `peak_extra_bytes` (negative where it holds less); None where not measured."""

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, **self.to_wire()}

    def to_wire(self, *, names_digest: bool = False) -> dict[str, Any]:
        """The ack as an engine sends it in its commit answer: no `engine` (the client
        names the engine it asked). `from_dict(d, engine=...)` reads it back. With
        `names_digest` and a `names_digest` set, the loaded names travel as their digest
        instead of the sorted list (tens of thousands of names for an MoE model), as they
        do when the digest is all this ack holds; otherwise as the list."""
        d: dict[str, Any] = {"version": self.version, "digests": list(self.digests)}
        if self.names_digest is not None and (names_digest or not self.loaded_names):
            d["names_digest"] = self.names_digest
        else:
            d["loaded_names"] = sorted(self.loaded_names)
        if self.tensor_digests:
            d["tensor_digests"] = dict(sorted(self.tensor_digests.items()))
        if self.held_slots:
            d["held_slots"] = {name: list(slots) for name, slots in sorted(self.held_slots.items())}
        if self.peak_extra_bytes is not None:
            d["peak_extra_bytes"] = self.peak_extra_bytes
        if self.kept_bytes is not None:
            d["kept_bytes"] = self.kept_bytes
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, engine: str | None = None) -> Ack:
        return cls(
            engine=engine or str(d.get("engine", "?")),
            version=int(d["version"]),
            digests=tuple(d.get("digests") or ()),
            loaded_names=frozenset(d.get("loaded_names") or ()),
            names_digest=None if d.get("names_digest") is None else str(d["names_digest"]),
            tensor_digests={str(k): str(v) for k, v in (d.get("tensor_digests") or {}).items()},
            held_slots={str(k): tuple(int(s) for s in v) for k, v in (d.get("held_slots") or {}).items()},
            peak_extra_bytes=_int_or_none(d.get("peak_extra_bytes")),
            kept_bytes=_int_or_none(d.get("kept_bytes")),
        )

    def without_memory(self) -> Ack:
        """This ack less its memory figures: what two workers of one engine must ack alike."""
        return replace(self, peak_extra_bytes=None, kept_bytes=None)

    @staticmethod
    def summed(acks: Sequence[Ack]) -> Ack:
        """The first of `acks` (the workers of one engine, which acked alike) with their memory
        figures summed, as the workers are separate processes of one host; None where any
        worker's is None."""
        def total(values: Sequence[int | None]) -> int | None:
            return None if any(v is None for v in values) else sum(v for v in values if v is not None)

        return replace(acks[0], peak_extra_bytes=total([a.peak_extra_bytes for a in acks]),
                       kept_bytes=total([a.kept_bytes for a in acks]))


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True, kw_only=True)
class StageSeconds:
    """Seconds spent per stage of a push. Stages overlap when pipelined, so
    their sum can exceed the push's wall time."""

    gather: float = 0.0
    """Reading or all-gathering tensors from the trainer (and merging LoRA)."""
    pack: float = 0.0
    """Copying tensors into flat bucket buffers."""
    hash: float = 0.0
    """Digesting buckets on the trainer."""
    wire: float = 0.0
    """Moving bytes to the engines (until every engine took the bucket)."""
    load: float = 0.0
    """Engine-side commit: applying the update and acking."""
    diff: float = 0.0
    """"sparse" mode: reading, casting and comparing every tensor with the acked version,
    encoding the changes and digesting the touched tensors, before anything is sent."""

    def to_dict(self) -> dict[str, float]:
        """Every stage; "diff" only where there was one (a "sparse" push)."""
        stages = ("gather", "pack", "hash", "wire", "load") + (("diff",) if self.diff else ())
        return {k: round(getattr(self, k), 6) for k in stages}


class Stages:
    """`StageSeconds` while a push runs: the pipeline and the modes add to its stages
    (`stages.wire += seconds`), `frozen()` is what the report keeps. Its stages are
    `StageSeconds`'s fields, declared there alone; any other name is an AttributeError."""

    _seconds: dict[str, float]

    def __init__(self, **seconds: float) -> None:
        object.__setattr__(self, "_seconds", asdict(StageSeconds(**seconds)))

    def __getattr__(self, stage: str) -> float:
        seconds = self.__dict__.get("_seconds", {})
        if stage not in seconds:
            raise AttributeError(f"no stage {stage!r} (the stages: {', '.join(seconds) or 'not made yet'})")
        return float(seconds[stage])

    def __setattr__(self, stage: str, value: float) -> None:
        if stage not in self._seconds:
            raise AttributeError(f"no stage {stage!r} (the stages: {', '.join(self._seconds)})")
        self._seconds[stage] = value

    def __repr__(self) -> str:
        return f"Stages({', '.join(f'{k}={v!r}' for k, v in self._seconds.items())})"

    def frozen(self) -> StageSeconds:
        return StageSeconds(**self._seconds)


@dataclass(frozen=True, kw_only=True)
class SyncReport:
    """The outcome of one `WeightSync.push`."""

    version: int
    """The weight version pushed."""
    mode: str
    """What was sent."""
    transport: str
    """How it moved."""
    num_bytes: int
    """Bytes of tensor data sent (per engine)."""
    num_tensors: int
    """Tensors sent."""
    num_buckets: int
    """Buckets sent."""
    seconds: float
    """Wall time of the whole push, pause to resume."""
    stages: StageSeconds = field(default_factory=StageSeconds)
    """Per-stage seconds."""
    verified: bool = False
    """True when every engine acked this version, every bucket digest and every name sent."""
    acks: tuple[Ack, ...] = ()
    """One ack per engine, each with the engine's own memory figures of this push
    (`Ack.peak_extra_bytes`, `Ack.kept_bytes`; None where it did not measure them)."""
    num_skipped: int = 0
    """Tensors left out because they were unchanged ("delta" mode)."""
    num_elements: int = 0
    """Tensor elements sent: every element of a dense tensor, the changed ones of a sparse one."""
    encodings: Mapping[str, int] = field(default_factory=dict)
    """How many tensors went in each encoding (`change_encoding.ENCODINGS`; a full push: all "dense")."""
    notes: tuple[str, ...] = ()
    """Anything a reader should know: why verification was partial, what was skipped."""
    phases: tuple[SyncReport, ...] = ()
    """The pushes of this version that went first, as phases of this one, each with its own
    bytes, tensors and stages ("lora": the base weights, where an engine did not serve the
    trainer's); the fields above are this mode's own, `seconds` spans them all."""
    commit: str = "staged"
    """How the engines committed, and so the promise this push kept (docs/GUARANTEES.md):
    "staged", all or nothing across replicas; "streamed", never a mix (an engine that
    failed midway refuses generation until a full push lands)."""

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9 bytes) per second over the whole push."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "mode": self.mode,
            "transport": self.transport,
            "num_bytes": self.num_bytes,
            "num_tensors": self.num_tensors,
            "num_buckets": self.num_buckets,
            "num_skipped": self.num_skipped,
            "num_elements": self.num_elements,
            "encodings": dict(self.encodings),
            "seconds": round(self.seconds, 6),
            "gbps": round(self.gbps, 4),
            "stages": self.stages.to_dict(),
            "verified": self.verified,
            "acks": [a.to_dict() for a in self.acks],
            "notes": list(self.notes),
            "commit": self.commit,
            **({"phases": [p.to_dict() for p in self.phases]} if self.phases else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SyncReport:
        return cls(
            version=int(d["version"]),
            mode=str(d["mode"]),
            transport=str(d["transport"]),
            num_bytes=int(d["num_bytes"]),
            num_tensors=int(d["num_tensors"]),
            num_buckets=int(d["num_buckets"]),
            num_skipped=int(d.get("num_skipped", 0)),
            num_elements=int(d.get("num_elements", 0)),
            encodings={str(k): int(v) for k, v in (d.get("encodings") or {}).items()},
            seconds=float(d["seconds"]),
            stages=StageSeconds(**d.get("stages", {})),
            verified=bool(d["verified"]),
            acks=tuple(Ack.from_dict(a) for a in d.get("acks", ())),
            notes=tuple(d.get("notes", ())),
            phases=tuple(SyncReport.from_dict(p) for p in d.get("phases", ())),
            commit=str(d.get("commit", "staged")),
        )
