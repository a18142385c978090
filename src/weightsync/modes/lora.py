"""mode="lora": only the adapter, loaded on the engines under a versioned name (`policy-v7`).

The first push, and the first after a failed one or an engine's restart, checks the engines' base
weights by digest and pushes them as a full update of the same version where they differ; other
pushes send the adapter tensors alone, uncast (engines cast adapters) unless a dtype is forced.
`AdapterRollover` keeps push N's adapter loaded until push N + keep has committed, then unloads it
in the background, retrying until each engine has none (docs/USAGE.md, "LoRA three ways").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, ClassVar

from torch import nn

from weightsync.engines.base import AdapterUnloader
from weightsync.errors import AdapterNotLoadedError, WeightSyncError
from weightsync.modes.base import ModeDefaults, ModeOptions, Planner, PushMode, Selection
from weightsync.modes.full import FullMode
from weightsync.naming import ExpertLayout
from weightsync.sources import AdapterSource, WeightSource, as_source

log = logging.getLogger(__name__)


class AdapterRollover:
    """The adapter names one `WeightSync` loaded, and the retiring of old ones.

    `engines` are those that unload adapters by name (`unloads_adapters`); an
    engine that cannot is left to its own eviction.
    """

    def __init__(self, *, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"lora_keep must be at least 1, got {keep}")
        self.keep = keep
        self._live: list[str] = []
        """Loaded names, oldest first; the last is current."""
        self._due: dict[str, set[int]] = {}
        """Retired name -> indices of the engines that still have to unload it."""
        self._lock = threading.Lock()
        self._job: Future[None] | None = None
        self._running = False
        """A background round runs: it takes what becomes due before it ends."""
        self._again = False
        """Something became due while the round ran."""

    @property
    def current(self) -> str | None:
        """The name requests should use now."""
        return self._live[-1] if self._live else None

    @property
    def live(self) -> tuple[str, ...]:
        """Names kept loaded, oldest first."""
        return tuple(self._live)

    @property
    def due(self) -> tuple[str, ...]:
        """Retired names some engine has not unloaded yet."""
        with self._lock:
            return tuple(self._due)

    def committed(self, lora_name: str, engines: Sequence[AdapterUnloader]) -> None:
        """Every engine acked `lora_name`: it becomes current; names past `keep` retire."""
        self._live = [n for n in self._live if n != lora_name] + [lora_name]
        retired, self._live = self._live[: -self.keep], self._live[-self.keep :]
        with self._lock:
            for name in retired:
                self._due[name] = set(range(len(engines)))

    def retire(self, engines: Sequence[AdapterUnloader], pool: Executor, *, timeout_s: float) -> None:
        """Unload what is due, in the background. A round that still runs (an unload waits
        for the requests using its adapter) goes on with what became due meanwhile, so each
        retired name goes once its last request ends, not at some later push."""
        with self._lock:
            if self._running:
                self._again = True
                return
            if not self._due:
                return
            self._running = True
        try:
            self._job = pool.submit(self._unload_rounds, engines, timeout_s)
        except BaseException:
            with self._lock:
                self._running = False
            raise

    def _unload_rounds(self, engines: Sequence[AdapterUnloader], timeout_s: float) -> None:
        again = True
        try:
            while again:
                self._unload_due(engines, timeout_s)
                with self._lock:
                    again, self._again = self._again, False
                    self._running = again
        except BaseException:
            with self._lock:
                self._running = False
            raise

    def finish(self, engines: Sequence[AdapterUnloader], *, timeout_s: float) -> None:
        """At close: wait (bounded) for a running round, then one more round here."""
        if self._job is not None:
            try:
                self._job.result(timeout=timeout_s * 1.2 + 1)
            except FutureTimeout:
                log.warning("unloading old adapters took longer than %.0fs; left: %s", timeout_s, self.due)
                return
        self._unload_due(engines, timeout_s)
        if self.due:
            log.warning("adapters %s could not be unloaded from every engine", list(self.due))

    def _unload_due(self, engines: Sequence[AdapterUnloader], timeout_s: float) -> None:
        with self._lock:
            work = [(name, sorted(indices)) for name, indices in self._due.items()]
        for name, indices in work:
            for i in indices:
                try:
                    engines[i].unload_lora(name, timeout_s=timeout_s)
                except AdapterNotLoadedError:
                    pass  # gone already (evicted, or an earlier try that timed out went through)
                except WeightSyncError as e:
                    log.warning("unloading adapter %s (will retry after the next push): %s", name, e)
                    continue
                with self._lock:
                    left = self._due.get(name)
                    if left is not None:
                        left.discard(i)
                        if not left:
                            del self._due[name]


class LoraMode(ModeDefaults):
    """A PEFT adapter under `<prefix>-v<version>`, retired by `AdapterRollover`."""

    name: ClassVar[str] = "lora"
    casts: ClassVar[bool] = False
    sends_adapter: ClassVar[bool] = True

    def __init__(self, options: ModeOptions | None = None) -> None:
        super().__init__(options)
        self.rollover = AdapterRollover(keep=self.options.lora_keep)
        self._base_checked = False
        self._instances: list[str | None] = []
        """The engines' process ids when the base was last checked."""
        self._base_due = False
        """A streamed push failed: the next push sends the base whole first (`failed`)."""

    @property
    def lora_name(self) -> str | None:
        return self.rollover.current

    def source(self, model: nn.Module | WeightSource, *, expert_layout: ExpertLayout = "per-expert") -> WeightSource:
        """The adapter's tensors (PEFT names; `expert_layout` does not apply to them)."""
        if not isinstance(model, nn.Module):
            return as_source(model)
        from weightsync.lora.source import LoraSource  # imports peft

        return LoraSource(model, adapter_name=self.options.adapter_name)

    def prepare(self, model: Any, version: int, planner: Planner) -> Sequence[PushMode]:
        """First push, and after a failure or an engine restart: make sure each engine that
        reports digests serves the trainer's base weights; where one does not, a full push
        of them as `version` goes first."""
        if self._base_due:  # a streamed push failed: an engine may refuse until a full push lands
            self._base_due = False
            return (FullMode(self.options),)
        if not any(c.reads_digests for c in planner.capabilities):
            return ()
        instances = planner.served_instances()
        if self._base_checked and instances == self._instances:
            return ()
        self._base_checked, self._instances = True, instances
        base = FullMode(self.options)
        trainer = planner.hash_tensors(base.source(model), cast=base.casts)
        if all(served == trainer for served in planner.served_digests(list(trainer))):
            return ()
        log.info("engine base weights differ from the trainer's: syncing them before the adapter")
        return (base,)

    def failed(self, version: int) -> None:
        self._base_checked = False
        # A streamed base phase that failed after its last bucket loaded leaves weights whose
        # digests are the trainer's on an engine that refuses generation: the digest check
        # would send the adapter alone, so the next push sends the base whole, unchecked.
        self._base_due = self.options.commit == "streamed"

    def select(self, source: WeightSource, version: int, planner: Planner) -> Selection:
        config = source.config() if isinstance(source, AdapterSource) else None
        if config is None:
            raise TypeError(f"mode='lora' needs a source with an adapter config, got {type(source).__name__}")
        return Selection(mode=self.name, metas=list(source.metas()), lora_config=config,
                         lora_name=f"{self.options.lora_prefix}-v{version}")

    def committed(self, selection: Selection, version: int, planner: Planner) -> None:
        assert selection.lora_name is not None
        unloaders = planner.unloaders()
        self.rollover.committed(selection.lora_name, unloaders)
        self.rollover.retire(unloaders, planner.pool, timeout_s=planner.timeout_s)

    def close(self, planner: Planner) -> None:
        if not self.rollover.due:
            return
        try:
            self.rollover.finish(planner.unloaders(), timeout_s=planner.timeout_s)
        except WeightSyncError as e:
            log.warning("unloading old adapters at close: %s", e)
