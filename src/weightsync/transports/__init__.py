"""Transports: how packed buckets move from the trainer to the engines.

Each transport module holds both ends: the trainer side (a `Transport`) and,
as that class's `receiver`, the engine side (a `Receiver`, used inside
`weightsync serve` and vLLM's workers, and read for its traits by the engine
clients). `REGISTRY` names every transport, "module:Class", imported on first
use; adding a transport is its module plus one line here.
`make_transport(name, ...)` builds the trainer side from the options
`WeightSync` holds, passing each class the ones its constructor takes (`root`
is `disk_root`); `make_receiver(name, ...)` builds the engine side.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from weightsync.links import Link
from weightsync.transports.base import Receiver, Transport

if TYPE_CHECKING:
    from weightsync.transports.broadcast import BroadcastTransport
    from weightsync.transports.disk import DiskTransport
    from weightsync.transports.http import HttpTransport
    from weightsync.transports.shm import ShmTransport

REGISTRY: dict[str, str] = {
    "disk": "weightsync.transports.disk:DiskTransport",
    "http": "weightsync.transports.http:HttpTransport",
    "broadcast": "weightsync.transports.broadcast:BroadcastTransport",
    "shm": "weightsync.transports.shm:ShmTransport",
}
"""Transport name -> "module:Class" of its trainer side."""

TRANSPORTS: tuple[str, ...] = tuple(REGISTRY)
"""Every transport name, in registry order."""

_NEEDS = {"root": "disk_root: a directory the engines can read"}
"""How to supply a constructor argument that has no default, by parameter name."""


def _registered(name: str) -> Any:
    """The class REGISTRY names for `name`, imported now."""
    try:
        target = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; valid names: {', '.join(TRANSPORTS)}") from None
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def transport_class(name: str) -> Callable[..., Transport]:
    """The trainer-side class of transport `name`, imported now."""
    cls: Callable[..., Transport] = _registered(name)
    return cls


def same_host_only(name: str) -> bool:
    """Whether transport `name` reaches engines on the trainer's host only (`Transport.same_host_only`)."""
    return bool(_registered(name).same_host_only)


def parse_link(d: Mapping[str, Any]) -> Link:
    """The link `d` (a `Link.to_dict()`) describes, as its transport's own record
    (`ShmLink`, ...); the transport's module is imported first. ValueError for an
    unknown transport or a missing field, naming it."""
    name = d.get("transport")
    if not isinstance(name, str):
        raise ValueError(f"a link names its transport; got {dict(d)}")
    _registered(name)
    return Link.from_dict(d)


def receiver_class(name: str) -> type[Receiver]:
    """The engine-side class of transport `name`, imported now; its traits
    (`joins_session`, `bytes_in_delivery`, `reads_at_commit`) are class attributes."""
    receiver: type[Receiver] = _registered(name).receiver
    return receiver


def make_receiver(name: str, *, max_sessions: int = 1, device: torch.device | None = None) -> Receiver:
    """The engine side of transport `name`, keeping at most `max_sessions` sessions
    joined at once (`device`: where device-side receives land, e.g. NCCL's)."""
    make: Callable[..., Receiver] = receiver_class(name)
    return make(max_sessions=max_sessions, device=device)


def make_transport(
    name: str,
    *,
    timeout_s: float = 60.0,
    disk_root: str | Path | None = None,
    keep_versions: int = 2,
    master_address: str = "127.0.0.1",
    backend: str | None = None,
    relay: bool = False,
) -> Transport:
    """The trainer-side transport called `name`, given the options of its constructor
    (`relay`: for `fan_out="relay"`, to a transport that takes it, broadcast; the others
    ignore it)."""
    cls = transport_class(name)
    options: dict[str, Any] = {"timeout_s": timeout_s, "root": disk_root, "keep_versions": keep_versions,
                               "master_address": master_address, "backend": backend, "relay": relay or None}
    kwargs: dict[str, Any] = {}
    for parameter in inspect.signature(cls).parameters.values():
        value = options.get(parameter.name)
        if value is not None:
            kwargs[parameter.name] = value
        elif parameter.default is inspect.Parameter.empty and parameter.kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            needs = _NEEDS.get(parameter.name, parameter.name)
            raise ValueError(f"transport={name!r} needs {needs}")
    return cls(**kwargs)


def __getattr__(attr: str) -> Any:
    """The transport classes by their class names (`from weightsync.transports import
    DiskTransport`), imported on first use."""
    for name, target in REGISTRY.items():
        if target.endswith(f":{attr}"):
            return transport_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = ["REGISTRY", "TRANSPORTS", "BroadcastTransport", "DiskTransport", "HttpTransport", "Receiver",
           "ShmTransport", "Transport", "make_receiver", "make_transport", "parse_link", "receiver_class",
           "transport_class"]
