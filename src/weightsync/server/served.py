"""The served weights of the embedded engine: its parameters, the received buffers they view,
the version and label they are served as, and every change to them, each made between two
generation steps (`between_steps`). A change adopts the tensors it is given (no copy); how
buffers go back to the receive pool, and the one change that copies (a streamed commit):
docs/ARCHITECTURE.md's design notes. It knows nothing of update sessions (`server.updates`),
of the undo of the last commit (`server.rollback`) or of HTTP.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from weightsync.errors import format_names
from weightsync.integrity import digest
from weightsync.manifest import TensorMeta
from weightsync.naming import map_names
from weightsync.server.buffers import BufferPool
from weightsync.server.coverage import Coverage, CoverageState
from weightsync.server.errors import NotFoundError
from weightsync.server.requests import ServedVersion

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class ServedState:
    """What was served at one moment, to serve it again (`ServedWeights.restore`):
    the same storages, not copies."""

    served: ServedVersion
    """The version and label."""
    params: dict[str, torch.Tensor]
    """hf_name -> every parameter's tensor."""
    backing: dict[str, torch.Tensor]
    """hf_name -> the received bucket buffer its parameter viewed."""
    coverage: CoverageState


class ServedWeights:
    """The parameters one model serves, what they view, and their version and label."""

    def __init__(self, model: nn.Module, *, version: int, label: str | None,
                 between_steps: Callable[[], ContextManager[None]], lock: threading.RLock) -> None:
        """`lock`: held while the served weights change (the updater's, so that a change
        and an update's commit never interleave)."""
        self.model = model
        self.params: dict[str, torch.Tensor] = {p.hf_name: p.param for p in map_names(model).params}
        self.metas: dict[str, TensorMeta] = {n: TensorMeta.of(n, p) for n, p in self.params.items()}
        self.served = ServedVersion(version, str(version) if label is None else label)
        """The served version and label; replaced whole, only between two steps, read lock-free."""
        self.between_steps = between_steps
        """Context manager holding generation between two steps (the scheduler's)."""
        self.buffers = BufferPool(max_bytes=sum(m.nbytes for m in self.metas.values()))
        """Receive buffers reused across updates (take one per bucket received)."""
        self.coverage = Coverage(self.params)
        """Whether the served weights are one update's (see `coverage`)."""
        self._lock = lock
        self._data: dict[str, torch.Tensor] = {n: p.detach() for n, p in self.params.items()}
        """hf_name -> the tensor its parameter's `.data` was last set to (the same storage, shape
        and strides): a `ServedState` copies this dict instead of making an alias of every
        parameter. Every assignment to a parameter's `.data` below records it here."""
        self._backing: dict[str, torch.Tensor] = {}
        """hf_name -> the received bucket buffer its served parameter views."""
        self._devices = {p.device for p in self.params.values()}
        """The devices the served parameters live on (one: this engine's)."""

    @property
    def version(self) -> int:
        """weightsync's served version."""
        return self.served.version

    @property
    def label(self) -> str:
        """SGLang's served `weight_version` label."""
        return self.served.label

    def digests(self, names: Iterable[str] | None = None) -> tuple[int, dict[str, str]]:
        """(version, hf_name -> xxh3 digest) of the served weights, read between two steps."""
        names = list(self.params) if names is None else list(names)
        unknown = [n for n in names if n not in self.params]
        if unknown:
            raise NotFoundError(f"unknown weight name(s): {format_names(unknown)}")
        with self.between_steps():
            return self.version, {n: digest(self.params[n].detach()) for n in names}

    def weights_by_name(self, name: str, truncate_size: int) -> tuple[list[Any], str]:
        """SGLang's `get_weights_by_name`: `tensor.tolist()[:truncate_size]` in float32, and the digest."""
        param = self.params.get(name)
        if param is None and name == "lm_head.weight" and getattr(self.model.config, "tie_word_embeddings", False):
            param = self.params.get("model.embed_tokens.weight")
        if param is None:
            raise NotFoundError(f"unknown weight name {name!r}; see /weightsync/info for the served names")
        with self.between_steps():
            values = param.detach().to(torch.float32).tolist()
            return (values[:truncate_size] if isinstance(values, list) else values), digest(param.detach())

    def set_label(self, label: str) -> None:
        """`/update_weight_version`: a new label for the same weights (the version stays)."""
        with self._lock, self.between_steps():
            self.served = ServedVersion(self.version, label)

    def serve(self, served: ServedVersion) -> None:
        """Serve the same parameters as `served` (an adapter loaded as a version)."""
        with self.between_steps():
            self.served = served

    def served_buffers(self) -> list[torch.Tensor]:
        """The received bucket buffers the served parameters view."""
        with self._lock:
            return list({id(b): b for b in self._backing.values()}.values())

    def swap(self, staged: Mapping[str, torch.Tensor], served: ServedVersion, *,
             owners: Mapping[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Make the staged tensors the served parameters between two steps, served as `served`;
        returns the receive buffers no parameter views any more (the caller gives them back).

        The staged tensors are adopted, not copied (they are owned by this update
        and never written again); `owners` names the bucket buffer each one views (names
        of `staged` only).
        """
        owners = owners or {}
        params, metas = self.params, self.metas
        for name, tensor in staged.items():
            meta = metas[name]  # the served shape and dtype, which never change
            assert tensor.shape == meta.shape and tensor.dtype is meta.dtype and tensor.is_contiguous(), \
                f"unchecked or unadoptable tensor {name}"
        # a view lives on its buffer's device: one check per buffer, not per tensor
        devices = {b.device for b in {id(b): b for b in owners.values()}.values()}
        devices.update(t.device for name, t in staged.items() if name not in owners)
        if len(self._devices) != 1 or not devices <= self._devices:
            for name, tensor in staged.items():
                assert tensor.device == params[name].device, f"unadoptable tensor {name} on {tensor.device}"
        with self.between_steps():
            for name, tensor in staged.items():
                params[name].data = tensor
            self._data.update(staged)
            self.served = served
            released = self._rebind_backing(staged, owners)
        log.info("v%d (%r) committed (%d tensor(s))", served.version, served.label, len(staged))
        return released

    def load_in_place(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write `tensors` (a streamed commit's checked bucket) into the served parameters
        between two steps. A parameter that views a received buffer (a staged commit served it
        from there, a transport's slot maybe) gets a copy of its own instead, so that no
        received buffer is written; so does one whose storage was released. The version and
        label are the caller's to change (`serve`), once every bucket loaded."""
        with self.between_steps():
            for name, tensor in tensors.items():
                data = self._data[name]
                if self._backing.pop(name, None) is not None or data.shape != tensor.shape:
                    self.params[name].data = self._data[name] = tensor.clone()
                else:
                    data.copy_(tensor)

    def saved(self) -> ServedState:
        """What is served now, to serve it again later (`restore`)."""
        return ServedState(served=self.served, params=dict(self._data), backing=dict(self._backing),
                           coverage=self.coverage.saved())

    def restore(self, state: ServedState) -> None:
        """Serve `state` again, bit for bit; the receive buffers only what it replaces
        viewed go back to the pool."""
        restored = {id(b) for b in state.backing.values()}
        dropped = {id(b): b for b in self._backing.values() if id(b) not in restored}
        with self.between_steps():
            for name, tensor in state.params.items():
                self.params[name].data = tensor
            self._data.update(state.params)
            self.served = state.served
            self._backing = dict(state.backing)
            self.coverage.restore(state.coverage)
        self.buffers.give(dropped.values())

    # -- memory occupation (SGLang's release/resume of "weights") -----------------------------

    def release(self) -> int:
        """Free every parameter, the buffers they view and the receive pool; returns the
        bytes freed. Nothing is served until `resume` and an update of every parameter."""
        with self.between_steps():
            storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.params.values()}
            storages.update({b.untyped_storage().data_ptr(): b.untyped_storage().nbytes()
                             for b in self._backing.values()})
            for name, param in self.params.items():
                param.data = self._data[name] = torch.empty(0, dtype=param.dtype)
            self._backing.clear()
            self.coverage.released()
        self.buffers.clear()
        log.info("weights released (%d bytes)", sum(storages.values()))
        return sum(storages.values())

    def reset(self, chosen: Callable[[str], bool]) -> list[str]:
        """Overwrite the `chosen` parameters with noise (SGLang's `/weights_checker`
        reset_tensors); returns their names. Nothing is served until an update rewrites them."""
        names = [n for n in self.params if chosen(n)]
        noise = {n: torch.randn(self.metas[n].shape).to(self.metas[n].dtype) for n in names}
        self.buffers.give(self.swap(noise, self.served))
        self.coverage.reset(kept=[n for n in self.params if n not in noise])
        return names

    def resume(self) -> int:
        """Allocate every parameter again (zeros, no weights in them: the next update of
        every parameter restores them); returns the bytes allocated."""
        with self.between_steps():
            for name, param in self.params.items():
                param.data = self._data[name] = torch.zeros(self.metas[name].shape, dtype=self.metas[name].dtype)
            self.coverage.resumed()
        return sum(m.nbytes for m in self.metas.values())

    def _rebind_backing(self, staged: Mapping[str, torch.Tensor],
                        owners: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Record which buffers the served parameters now view; return the buffers that
        backed the replaced parameters, which no parameter views any more. Parameters
        left on such a buffer by a partial update are cloned out of it first, so no
        buffer is kept alive for a few of its bytes."""
        backing = self._backing
        replaced = {id(b): b for b in map(backing.pop, staged, itertools.repeat(None)) if b is not None}
        kept = backing.keys() - staged.keys()  # served as before (none, in a full update)
        backing.update(owners)
        for name in kept:
            if id(backing[name]) in replaced:
                self.params[name].data = self._data[name] = self.params[name].detach().clone()
                del backing[name]
        return list(replaced.values())


__all__ = ["ServedState", "ServedWeights"]
