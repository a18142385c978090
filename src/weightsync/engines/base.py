"""The Engine protocol: what the coordinator asks of every inference engine, the records it hands
each call (`EngineUpdate`, `PausePolicy`), what an engine declares (`EngineCapabilities`) and the
verbs only some engines have (`verbs_of`). An engine client turns the verbs into its engine's API
and keeps nothing of a push between calls. Every call made for a push is bounded by the push's
`timeout_s` (`update.link.timeout_s`, or the `timeout_s` a verb takes); a client's own
`timeout_s` bounds only the calls a user makes directly (generate, info).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from weightsync.dtypes import dtype_from_name, dtype_name
from weightsync.formats.quantized import Quantization
from weightsync.formats.shares import Share
from weightsync.links import Delivery, Link
from weightsync.manifest import BucketMeta, Manifest
from weightsync.naming import EXPERT_LAYOUTS, ExpertLayout
from weightsync.reports import Ack

__all__ = ["CLEANUP_TIMEOUT_S", "AdapterUnloader", "Completion", "Delivery", "DigestReader", "Engine",
           "EngineCapabilities", "EngineUpdate", "Extended", "Link", "PausePolicy", "verbs_of"]

CLEANUP_TIMEOUT_S = 10.0
"""Upper bound of a failed push's cleanup (abort, rollback, leaving the session, resume),
never more than the push's `timeout_s`: the coordinator's cleanup rounds together, and each
engine client's abort and teardown call. They run after a failure, often against a peer
that already stopped answering."""


class PausePolicy(StrEnum):
    """What happens to in-flight requests while weights change.

    One policy maps onto both engines' own modes:

    | policy   | SGLang `pause_generation` | vLLM `/pause?mode=` |
    |----------|---------------------------|---------------------|
    | none     | (no pause)                | (no pause)          |
    | abort    | abort                     | abort               |
    | retract  | retract                   | wait                |
    | in_place | in_place                  | keep                |

    retract/wait never lose a request; in_place/keep keep the KV cache too.
    """

    NONE = "none"
    ABORT = "abort"
    RETRACT = "retract"
    IN_PLACE = "in_place"

    @property
    def sglang_mode(self) -> str | None:
        return None if self is PausePolicy.NONE else self.value

    @property
    def vllm_mode(self) -> str | None:
        return {
            PausePolicy.NONE: None,
            PausePolicy.ABORT: "abort",
            PausePolicy.RETRACT: "wait",
            PausePolicy.IN_PLACE: "keep",
        }[self]

    @classmethod
    def parse(cls, value: str | PausePolicy) -> PausePolicy:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown pause policy {value!r}; one of {[p.value for p in cls]}") from None


@dataclass(frozen=True, kw_only=True)
class Completion:
    """One generated answer, as the engine reported it."""

    output_ids: list[int]
    """Generated token ids."""
    logprobs: list[float]
    """Log-probability of each generated token under the engine's weights."""
    weight_version: str
    """The weight version the engine reported for this answer."""
    finish_reason: str
    """"length", "stop" or "abort"."""
    text: str = ""
    """Decoded text, where the engine has a tokenizer."""


@dataclass(frozen=True, kw_only=True)
class EngineCapabilities:
    """What one engine can do, as the engine declares it (asked once per transport session)."""

    num_ranks: int = 1
    """Ranks the engine joins a broadcast group with (its TP x PP size)."""
    dtype: torch.dtype | None = None
    """The dtype the engine serves floating weights in; floating tensors are cast to
    it in the stream. None: unknown (a stock SGLang), tensors go as the trainer holds them."""
    kept_dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)
    """Floating tensors the engine keeps in a dtype other than `dtype` (engine name -> that
    dtype): transformers' `_keep_in_fp32_modules_strict` and vLLM keep a GLM-4.5 or
    DeepSeek-V3 router's `e_score_correction_bias` in float32 under a bfloat16 model. These
    travel in their own dtype, so a float32 master's values reach them exactly."""
    stages_updates: bool = False
    """Updates are staged and swapped in at commit, so the coordinator pauses only
    around the commit; otherwise it pauses from begin to commit."""
    pauses_at_commit: bool = False
    """The engine pauses generation for the commit itself when the commit request names
    a pause mode (`protocol.CommitRequest.pause`) and resumes when it ends: a push
    then makes no pause and resume round trips."""
    supports_delta: bool = True
    """The engine applies a partial ("delta") update on top of a version it can prove
    it holds; otherwise delta pushes go out whole."""
    supports_sparse: bool = False
    """The engine applies a "sparse" update (changed elements only) on top of the version
    it serves, checking every touched tensor's whole digest; otherwise sparse pushes go
    out whole. False unless declared: an engine that does not know the mode cannot."""
    adopts_shm: bool = False
    """The engine serves a full update's tensors straight from the shm slots they came in
    (no copy out of the slot) and names the slots it holds in its ack (`Ack.held_slots`);
    the trainer then packs every bucket of a push into a slot no engine holds."""
    reads_digests: bool = False
    """The engine reports digests of its served weights (`DigestReader`); a first
    "lora" push uses them to check the base weights."""
    unloads_adapters: bool = False
    """The engine unloads LoRA adapters by name (`AdapterUnloader`); "lora" pushes
    retire old versions through it."""
    rolls_back: bool = False
    """The engine can undo its last commit until its next update begins (`Rollbacker`): the
    coordinator commits these engines first and rolls them back when another engine does
    not commit, so a push to several replicas is all or nothing."""
    relays: bool = False
    """The engine forwards each bucket it received, after checking and staging it, to the
    next engine (`fan_out="relay"`, `Relayer`): over http, to the engine the frame names;
    over broadcast, to the next engine's rank in the group. A push to several replicas
    then crosses the trainer's link once."""
    assembles_shares: bool = False
    """The engine takes a bucket in shares, one per trainer rank, over http, and assembles
    it (`weightsync.formats.shares`, `SyncConfig.send_shares`): a sharded trainer's ranks then each
    send their own rows, with no gather to one rank."""
    transports: frozenset[str] = frozenset()
    """Transports the engine takes full, delta and merged updates over, as it reports
    them now (a stock SGLang: fewer than its client's `Engine.transports`)."""
    lora_transports: frozenset[str] = frozenset()
    """Transports the engine takes a LoRA adapter over (empty: no LoRA)."""
    fused_groups: tuple[tuple[str, ...], ...] = ()
    """Checkpoint tensors the engine only loads together (vLLM reloads a fused
    qkv_proj or gate_up_proj from all of its checkpoint tensors at once): a delta
    that changes one tensor of a group sends the whole group."""
    streams_commit: bool = False
    """The engine takes a streamed commit (`Manifest.commit == "streamed"`): each bucket loaded
    into the served weights once its digest checks, generation held until the commit, and a
    failure midway leaves it refusing generation until a full push lands."""
    expert_layout: ExpertLayout = "per-expert"
    """How the engine loads a Mixture-of-Experts model's experts (`naming.ExpertLayout`):
    "per-expert" checkpoint tensors (vLLM, SGLang: what `save_pretrained` writes), or
    "fused" 3-D parameters (`weightsync serve`, which holds transformers' model). A
    trainer's fused experts are sent as per-expert views for the first."""
    quantization: Quantization | None = None
    """The engine serves quantized linear weights (`formats.quantized`): the trainer quantizes
    them in the stream, each with its scale, and a plain push is refused. None: floating weights."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form an engine serves (`/weightsync/info` "capabilities")."""
        return {
            "num_ranks": self.num_ranks, "dtype": None if self.dtype is None else dtype_name(self.dtype),
            **({"kept_dtypes": {n: dtype_name(d) for n, d in self.kept_dtypes.items()}} if self.kept_dtypes else {}),
            "stages_updates": self.stages_updates, "pauses_at_commit": self.pauses_at_commit,
            "supports_delta": self.supports_delta, "supports_sparse": self.supports_sparse,
            "adopts_shm": self.adopts_shm, "reads_digests": self.reads_digests,
            "unloads_adapters": self.unloads_adapters, "rolls_back": self.rolls_back,
            **({"relays": True} if self.relays else {}),
            **({"assembles_shares": True} if self.assembles_shares else {}),
            **({"streams_commit": True} if self.streams_commit else {}),
            "transports": sorted(self.transports), "lora_transports": sorted(self.lora_transports),
            **({"fused_groups": [list(g) for g in self.fused_groups]} if self.fused_groups else {}),
            "expert_layout": self.expert_layout,
            **({"quantization": self.quantization.to_dict()} if self.quantization else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineCapabilities:
        """Parse `to_dict`'s form; unknown keys are ignored (a newer engine may say more)."""
        dtype = d.get("dtype")
        return cls(
            num_ranks=int(d.get("num_ranks", 1)), dtype=dtype_from_name(str(dtype)) if dtype else None,
            kept_dtypes={str(n): dtype_from_name(str(v)) for n, v in (d.get("kept_dtypes") or {}).items()},
            stages_updates=bool(d.get("stages_updates", False)),
            pauses_at_commit=bool(d.get("pauses_at_commit", False)),
            supports_delta=bool(d.get("supports_delta", True)),
            supports_sparse=bool(d.get("supports_sparse", False)),
            adopts_shm=bool(d.get("adopts_shm", False)),
            reads_digests=bool(d.get("reads_digests", False)),
            unloads_adapters=bool(d.get("unloads_adapters", False)),
            rolls_back=bool(d.get("rolls_back", False)),
            relays=bool(d.get("relays", False)),
            assembles_shares=bool(d.get("assembles_shares", False)),
            streams_commit=bool(d.get("streams_commit", False)),
            transports=frozenset(d.get("transports") or ()), lora_transports=frozenset(d.get("lora_transports") or ()),
            fused_groups=tuple(tuple(str(n) for n in g) for g in d.get("fused_groups") or ()),
            quantization=Quantization.from_dict(d["quantization"]) if d.get("quantization") else None,
            expert_layout=_expert_layout(d.get("expert_layout", "per-expert")),
        )


def _expert_layout(value: object) -> ExpertLayout:
    for layout in EXPERT_LAYOUTS:
        if value == layout:
            return layout
    raise ValueError(f"unknown expert_layout {value!r}; one of {list(EXPERT_LAYOUTS)}")


@dataclass(kw_only=True)
class EngineUpdate:
    """One push's update on one engine: made by the coordinator for each push (after the
    transport session is joined) and handed to every verb of that push, so the engine
    client keeps nothing of a push between calls. The coordinator writes every field but
    `engine_session`, which the client's `begin` and `commit`/`abort` keep."""

    version: int
    """The version this push sends."""
    link: Link
    """The engine's link in the transport session; `link.timeout_s` bounds every call."""
    owner: str | None = None
    """The trainer sending it (`Manifest.owner`): an abort or rollback names it, so that
    another trainer's update is never dropped."""
    policy: PausePolicy = PausePolicy.NONE
    """The push's pause policy (also what a commit does with caches: SGLang flushes them
    unless requests keep running on them, `in_place`)."""
    pause_at_commit: bool = False
    """The coordinator chose to have the commit request pause generation for the commit
    (`EngineCapabilities.pauses_at_commit`) instead of a pause call: the engine resumes
    by itself once the commit is answered."""
    pause_id: str | None = None
    """The id of the pause sent to the engine in this push (None: none sent): the resume names it."""
    resumed_by_commit: bool = False
    """The commit carried the pause and was answered: the engine resumed by itself."""
    checked: bool = False
    """`ready` answered: the engine checked everything its commit would (vLLM: every rank
    sealed the update), so the commit need not check again."""
    forwards: bool = False
    """Relayed in a broadcast group: this engine sends every bucket on to the next one
    (`Relayer.relay_in_group`), and has not relayed until it has."""
    engine_session: bool = False
    """The engine's own update session is open (SGLang's `/begin_weight_update`, which
    `begin` opened): commit or abort ends it. Kept by the engine client."""


@runtime_checkable
class Engine(Protocol):
    """A client for one inference engine (one replica, possibly several ranks). A push calls,
    in order: `capabilities` (once per transport session), `connect` (once per session),
    `pause` (before begin, after the stream, or carried by the commit), `begin`, `receive`
    per bucket, `ready` (with several replicas), `commit`, `resume`; `abort` on any failure."""

    transports: ClassVar[frozenset[str]]
    """Transports this engine can receive full/delta updates over."""
    lora_transports: ClassVar[frozenset[str]]
    """Transports this engine can receive a LoRA adapter over ("disk" = PEFT directory)."""
    label: str
    """How the engine is named in reports and errors (its URL)."""

    @property
    def url(self) -> str | None:
        """Where the engine answers (None: in the trainer's process)."""

    @property
    def transports_note(self) -> str | None:
        """Why `transports` leaves some out, for the error that refuses one (None: nothing to say)."""

    def capabilities(self, timeout_s: float) -> EngineCapabilities:
        """What the engine can do; may ask the engine (within `timeout_s`)."""

    def connect(self, link: Link) -> None:
        """Join a transport session (blocks, e.g. until a group forms)."""

    def disconnect(self, link: Link) -> None:
        """Leave a transport session; never raises for an already-gone peer."""

    def pause(self, policy: PausePolicy, *, pause_id: str | None = None, timeout_s: float | None = None) -> None:
        """Stop or hold generation per `policy` before an update. `pause_id` names this pause
        (an engine that can cancels it should it arrive after the resume naming it)."""

    def resume(self, *, pause_id: str | None = None, timeout_s: float | None = None) -> None:
        """Continue generation after an update (or after an abort); `pause_id`: the id of the
        pause this ends (None: none was sent with an id)."""

    def begin(self, manifest: Manifest, update: EngineUpdate) -> str | None:
        """Check `manifest` against the engine's weights and open an update.

        Raises ManifestMismatchError naming every offender; nothing changes. An
        engine busy with another live trainer's session raises EngineError 409 with
        `retry_after_s`. Returns a note for the report (e.g. that a dead trainer's
        session was discarded), or None.
        """

    def receive(self, bucket: BucketMeta, delivery: Delivery, update: EngineUpdate) -> None:
        """Take one bucket of `update`; the engine verifies its digest before use."""

    def ready(self, manifest: Manifest, update: EngineUpdate) -> None:
        """Raise unless the engine can still commit `manifest` (its final digests in):
        the round before the commit round when a push has several replicas, so that an
        engine that cannot commit (unreachable, restarted, its session expired, and where
        the engine can check it now, bytes that are not the trainer's) is found before
        any engine commits. Applies nothing."""

    def commit(self, manifest: Manifest, update: EngineUpdate) -> Ack:
        """Apply the update, flush caches derived from old weights, ack; pause generation
        for the commit where `update.pause_at_commit`."""

    def abort(self, update: EngineUpdate, *, timeout_s: float | None = None) -> None:
        """Discard `update`; the engine keeps its last good version."""


@runtime_checkable
class Extended(Protocol):
    """An engine client whose engine may do more than its API's (`Relayer`, `ShareReceiver`,
    `Rollbacker`, `DigestReader`), which it hands out in a client of their own once it knows its
    engine has them (`SGLangEngine` on `weightsync serve`: `engines.serve.ServeClient`). The
    engine declares which of them it does (`EngineCapabilities`); the coordinator asks only those."""

    def extension(self, timeout_s: float) -> object | None:
        """The client of the engine's own verbs, or None where the engine has none; asks the
        engine (within `timeout_s`) unless its capabilities were asked."""


def verbs_of(engine: Engine, timeout_s: float) -> object:
    """Where the verbs beyond `Engine` that `engine` declared are called: its client's extension
    (`Extended`), else the engine client itself (a client written with those verbs)."""
    extension = engine.extension(timeout_s) if isinstance(engine, Extended) else None
    return engine if extension is None else extension


@runtime_checkable
class DigestReader(Protocol):
    """An engine that reports digests of the weights it serves (`reads_digests`)."""

    def digests(self, hf_names: Sequence[str] | None = None, *, timeout_s: float | None = None) -> dict[str, str]:
        """hf_name -> xxh3 digest of the served tensor."""

    def instance(self, *, timeout_s: float | None = None) -> str | None:
        """An id the engine process drew when it started (None: it has none): another id
        than before means the engine restarted and serves its checkpoint's weights again."""


@runtime_checkable
class Relayer(Protocol):
    """An engine that forwards the buckets it receives to other engines (`relays`)."""

    label: str

    def relay(self, bucket: BucketMeta, delivery: Delivery, update: EngineUpdate, forward: Sequence[str]) -> None:
        """Take one bucket, as `Engine.receive`, and have it forwarded along `forward` (the
        URLs of the other engines, in order), each engine checking its digest first (http)."""

    def relay_in_group(self, manifest: Manifest, update: EngineUpdate, *, source: tuple[str, Link] | None,
                       forward: tuple[str, Link] | None) -> None:
        """Over a collective transport (broadcast), before the first bucket: have the engine
        take every bucket of `manifest` from the rank of `source` (its label and link; None:
        the trainer, rank 0), check its digest, stage it and send it on to the rank of
        `forward` (None: this engine is the last; the coordinator sets `update.forwards`
        otherwise). Returns once the engine has started; `wait_relayed` says how the relay ended."""

    def wait_relayed(self, manifest: Manifest, update: EngineUpdate) -> None:
        """Return once every bucket of `manifest` is staged here (and, where `update.forwards`,
        sent on); raise, naming the engine and the hop, where the relay into this engine or
        out of it failed."""

    def relay_error(self, version: int, *, timeout_s: float) -> str | None:
        """Why the relay of `version` stopped at this engine, naming the hop, or None (one
        look, within `timeout_s`)."""


@runtime_checkable
class ShareReceiver(Protocol):
    """An engine client that sends one trainer rank's share of a bucket (`assembles_shares`)."""

    label: str

    def receive_share(self, share: Share, forward: Sequence[str], *, timeout_s: float) -> None:
        """Send `share` (`weightsync.formats.shares`) to this engine, which checks it, copies it into
        its bucket and, where `forward` names further engines (their URLs, in order), sends
        it on along them; any trainer rank may call it, without a session of its own."""


@runtime_checkable
class Rollbacker(Protocol):
    """An engine that undoes its last commit (`rolls_back`)."""

    label: str

    def rollback(self, version: int, *, owner: str | None = None, timeout_s: float | None = None) -> bool:
        """Serve again what was served before the commit of `version` by the trainer `owner`
        (`Manifest.owner`), while no update began since; True if undone, False where `version` is not served (never
        committed). Raises where it is served and cannot be undone."""


@runtime_checkable
class AdapterUnloader(Protocol):
    """An engine that unloads LoRA adapters by name (`unloads_adapters`)."""

    def unload_lora(self, lora_name: str, *, timeout_s: float | None = None) -> None:
        """Stop serving `lora_name` (after the requests still using it finish).

        Raises `AdapterNotLoadedError` when no adapter of that name is loaded.
        """
