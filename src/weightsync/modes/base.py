"""The spec every push mode implements (`PushMode`), and what a mode is given to plan with.

A mode decides WHAT one push sends; the coordinator (`weightsync.push.sync`) decides HOW: bucket
plan, begin, stream, commit, verify. A mode keeps its own state across pushes (delta: the digests
the engines hold; lora: the adapter names loaded); the coordinator keeps none for it.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from torch import nn

from weightsync.dtypes import Cast
from weightsync.engines.base import AdapterUnloader, EngineCapabilities
from weightsync.errors import EngineError, WeightSyncError
from weightsync.manifest import TensorMeta
from weightsync.naming import ExpertLayout, expert_stacks
from weightsync.reports import Stages
from weightsync.sources import ModuleSource, StackedSource, WeightSource, as_source
from weightsync.stacking import ExpertStack
from weightsync.trainer_ranks import TrainerRanks


@dataclass(frozen=True, kw_only=True)
class ModeOptions:
    """The user's options a mode reads (from `SyncConfig`)."""

    adapter_name: str | None = None
    """The PEFT adapter to sync (default: the model's active one)."""
    lora_prefix: str = "policy"
    """"lora": adapters load as `<lora_prefix>-v<version>`."""
    lora_keep: int = 2
    """"lora": adapter versions kept loaded per engine (see `modes.lora.AdapterRollover`)."""
    sparse_snapshot: str = "trainer"
    """"sparse": where the copy of the acked version lives, "trainer" (each tensor's own
    device) or "host" (CPU memory); one model copy in the engines' dtype either way."""
    commit: str = "staged"
    """How engines commit ("staged" or "streamed", `SyncConfig.commit`): after a failed
    streamed push an engine may refuse generation until a full push lands ("lora" sends its
    base whole first)."""


@dataclass(frozen=True, kw_only=True)
class Selection:
    """What one push sends, as its mode chose it."""

    mode: str
    """The manifest's mode ("delta" sends "full" when no base can be proven)."""
    metas: Sequence[TensorMeta]
    """The source's tensors to send (trainer names and dtypes), in source order."""
    num_skipped: int = 0
    """Tensors of the source left out (delta: unchanged since the acked version)."""
    lora_config: Mapping[str, Any] | None = None
    """"lora": the adapter_config.json contents."""
    lora_name: str | None = None
    """"lora": the name the adapter loads under."""
    base_version: int | None = None
    """"delta", "sparse": the version the engines must hold for the update to apply."""
    stream: WeightSource | None = None
    """What the pipeline packs instead of reading the source again ("sparse": payloads
    and cast tensors it already holds); its tensors must fit `metas`' entries."""
    follower_step: Mapping[str, Any] | None = None
    """What the other trainer ranks run (`PushMode.follow`) while the sender streams
    `stream` (None: they gather the source's tensors along)."""
    digest_algorithm: str | None = None
    """The push's digest algorithm, where the mode needs one (None: the session's)."""


class Planner(Protocol):
    """What a mode plans with: plain values known before it plans, and the calls that run a round
    across the engines or the trainer's ranks (or read the source once per push)."""

    pool: Executor
    """For a mode's background work (lora: unloading retired adapters)."""
    timeout_s: float
    """The push's bound for every engine call."""
    digest_algorithm: str
    """The algorithm this push's digests are computed with."""
    allow_overflow: bool
    """Casts may turn finite values into infinities (`SyncConfig.allow_overflow`)."""
    stages: Stages
    """This push's seconds per stage (a mode adds what it spends, e.g. `diff`)."""
    ranks: TrainerRanks
    """The trainer's ranks (one, unless the `WeightSync` has a process_group)."""
    capabilities: Sequence[EngineCapabilities]
    """Every engine's declared capabilities, as the session's handshake answered them (none at a
    close that follows no handshake)."""
    cast: Cast
    """The dtype each floating tensor of this mode's push travels in (`PushMode.casts`; `Cast.to`
    None: as the trainer holds them)."""

    def share_step(self, step: Mapping[str, Any]) -> None:
        """Have every other trainer rank run `step` (`PushMode.follow`) now."""
        ...

    def metas(self, source: WeightSource) -> list[TensorMeta]:
        """`source.metas()`, read once per push (tens of thousands of tensors cost
        milliseconds to read); the list is shared: copy it before changing it."""
        ...

    def hash_tensors(self, source: WeightSource, *, cast: bool) -> dict[str, str]:
        """hf_name -> digest of every tensor of `source` as the engines would hold it
        (cast to their dtype where floating, with `cast`); every trainer rank gathers."""
        ...

    def served_digests(self, hf_names: Sequence[str]) -> list[dict[str, str]]:
        """hf_name -> digest of the served weights, from each engine that reports them."""
        ...

    def served_instances(self) -> list[str | None]:
        """The process id (`DigestReader.instance`) of each engine that reports digests."""
        ...

    def unloaders(self) -> Sequence[AdapterUnloader]:
        """The engines that unload LoRA adapters by name (at a close after the session was left,
        the engines are asked their capabilities again)."""
        ...


class PushMode(Protocol):
    """One way of choosing what a push sends ("full", "delta", "lora", "lora-merged", "sparse").
    For every push the coordinator calls, in order: `source`, `prepare`, `select`, (begin on
    every engine; `refused` where one refused, then `select` again if it says so), (stream,
    commit, verify), then `committed` after every engine acked, or `failed`; `close` once, when
    the `WeightSync` closes."""

    name: ClassVar[str]
    """The name users pass as `mode=`."""
    casts: ClassVar[bool]
    """Floating tensors travel in the engines' dtype (False: as the trainer holds them,
    unless the user forces a dtype)."""
    sends_adapter: ClassVar[bool]
    """Pushes carry a LoRA adapter (engines load it by name), so they go over the
    engines' `lora_transports`; otherwise over their `transports`."""
    digests_from_parts: ClassVar[bool]
    """With a `process_group`, the digest of each whole tensor is combined from its ranks'
    parts ("sparse"), which only `digests.COMBINABLE` algorithms can."""
    sends_shares: ClassVar[bool]
    """Every trainer rank can send its own rows of the model's tensors as they are held
    (`SyncConfig.send_shares`): the mode sends every tensor whole, chooses nothing."""

    @property
    def lora_name(self) -> str | None:
        """The adapter name requests should use now (lora modes), else None."""
        ...

    def source(self, model: nn.Module | WeightSource, *, expert_layout: ExpertLayout = "per-expert") -> WeightSource:
        """The stream this mode reads from `model`, Mixture-of-Experts layers in the layout
        the engines load (`EngineCapabilities.expert_layout`)."""
        ...

    def prepare(self, model: Any, version: int, planner: Planner) -> Sequence[PushMode]:
        """Before planning `version`: the modes whose pushes of `version` go first, as phases
        of this push that the report lists (lora: the base weights where an engine does not
        serve the trainer's); usually none."""
        ...

    def select(self, source: WeightSource, version: int, planner: Planner) -> Selection:
        """The tensors and manifest fields of this push."""
        ...

    def refused(self, selection: Selection, error: EngineError) -> bool:
        """An engine refused the manifest at begin: True to select again (nothing moved)."""
        ...

    def committed(self, selection: Selection, version: int, planner: Planner) -> None:
        """Every engine acked `version`."""
        ...

    def failed(self, version: int) -> None:
        """The push of `version` failed: no engine serves it, and an engine may have been
        restarted since the last push (serving its checkpoint's weights again)."""
        ...

    def close(self, planner: Planner) -> None:
        """The `WeightSync` closes."""
        ...

    def follow(self, model: Any, step: Mapping[str, Any], order: Sequence[str] | None, ranks: TrainerRanks,
               *, timeout_s: float) -> None:
        """On a trainer rank that does not send: the part of `step` (sent by the sender's
        mode through `Planner.share_step` or `Selection.follower_step`) this rank runs."""
        ...


class ModeDefaults:
    """The verbs most modes leave as they are: the whole source, nothing to remember."""

    name: ClassVar[str]
    casts: ClassVar[bool] = True
    sends_adapter: ClassVar[bool] = False
    digests_from_parts: ClassVar[bool] = False
    sends_shares: ClassVar[bool] = False

    def __init__(self, options: ModeOptions | None = None) -> None:
        self.options = options or ModeOptions()
        self._named: tuple[weakref.ref[nn.Module], list[object], ModuleSource, ExpertLayout,
                           tuple[ExpertStack, ...]] | None = None
        """The model the last module source named (held weakly: a model the trainer dropped
        is not kept alive), its tree's fingerprint, that source without its model, the layout,
        and the fused tensors its per-expert ones stack into (that layout "fused")."""

    @property
    def lora_name(self) -> str | None:
        return None

    def source(self, model: nn.Module | WeightSource, *, expert_layout: ExpertLayout = "per-expert") -> WeightSource:
        """The module's base weights, named by walking its tree (fused experts as
        `expert_layout` says: a model holding its experts one by one, into the "fused" layout,
        sends them stacked, `sources.stacked`); the walk of the last push is reused while the
        tree is the same object for object (`tree_fingerprint`) and the layout the same, as
        it is when an RL loop pushes one model step after step."""
        if not isinstance(model, nn.Module):
            return as_source(model, expert_layout=expert_layout)
        fingerprint = tree_fingerprint(model)
        if (self._named is not None and self._named[0]() is model and self._named[1] == fingerprint
                and self._named[3] == expert_layout):
            source = copy.copy(self._named[2])  # its names and caches, shared (they describe this tree)
        else:
            source = ModuleSource(model, adapter_name=self.options.adapter_name, expert_layout=expert_layout)
            unbound = copy.copy(source)
            del unbound.model
            stacks = expert_stacks(model, adapter_name=self.options.adapter_name) if expert_layout == "fused" else ()
            self._named = (weakref.ref(model), fingerprint, unbound, expert_layout, stacks)
        source.model = model
        stacks = self._named[4]
        return StackedSource(source, stacks) if stacks else source

    def prepare(self, model: Any, version: int, planner: Planner) -> Sequence[PushMode]:
        return ()

    def select(self, source: WeightSource, version: int, planner: Planner) -> Selection:
        return Selection(mode=self.name, metas=list(planner.metas(source)))

    def refused(self, selection: Selection, error: EngineError) -> bool:
        return False

    def committed(self, selection: Selection, version: int, planner: Planner) -> None:
        return None

    def failed(self, version: int) -> None:
        return None

    def close(self, planner: Planner) -> None:
        return None

    def follow(self, model: Any, step: Mapping[str, Any], order: Sequence[str] | None, ranks: TrainerRanks,
               *, timeout_s: float) -> None:
        raise WeightSyncError(f"mode {self.name!r} has no step for the other trainer ranks (asked {dict(step)})")


def tree_fingerprint(model: nn.Module) -> list[object]:
    """Every module of `model` (depth first) as its type, its identity, its parameters' and
    children's attribute names and the identities of those parameters and children: equal
    for two calls exactly when naming the tree again would give the same names (the walk
    reads nothing else), so a source's names may be reused while it stays equal. About a
    microsecond per module: names and identities are laid out in C (`list +=`, `map`)."""
    out: list[object] = []
    stack: list[nn.Module | None] = [model]
    while stack:
        module = stack.pop()
        if module is None:  # an empty child slot: recorded in its parent's names and ids
            continue
        params, children = module._parameters, module._modules
        # per module: its type, its id, names (str) then ids (int) of its parameters, then of
        # its children; a type is neither a str nor an int, so the list reads back one way
        out.append(type(module))
        out.append(id(module))
        if params:
            out += params
            out += map(id, params.values())
        if children:
            out += children
            out += map(id, children.values())
            stack += children.values()
    return out
