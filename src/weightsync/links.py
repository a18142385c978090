"""What a transport tells an engine: the `Link` (how one engine reaches one transport
session) and the `Delivery` (where it finds one bucket's bytes).

Engines never import transports; these plain records are what crosses between them.
Each transport subclasses `Link` in its own module. Frozen dataclasses with a JSON
form; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, kw_only=True)
class Link:
    """How one engine reaches one transport session (made by the transport).

    Each transport module defines its own subclass with the fields its engine end
    needs (`transports.shm.ShmLink`, ...), declared with its name:
    `class ShmLink(Link, transport="shm")`. `from_dict` rebuilds the subclass the
    "transport" field names, once that module is imported
    (`weightsync.transports.parse_link` imports it first).
    """

    transport: str
    """The transport's name in `weightsync.transports.REGISTRY`."""
    timeout_s: float = 60.0
    """Timeout for the engine's side of every collective and copy."""

    _KINDS: ClassVar[dict[str, type[Link]]] = {}

    def __init_subclass__(cls, *, transport: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if transport is not None:
            Link._KINDS[transport] = cls

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Link:
        """The link `d` describes, as the subclass its "transport" declared (a plain
        `Link` for a transport whose link has no fields of its own)."""
        kind = Link._KINDS.get(str(d.get("transport")), Link) if cls is Link else cls
        fields = kind.__dataclass_fields__
        missing = sorted(n for n, f in fields.items() if n not in d and f.default is MISSING
                         and f.default_factory is MISSING)
        if missing:
            raise ValueError(f"a {d.get('transport')!r} link needs {missing}; got {dict(d)}")
        return kind(**{k: v for k, v in d.items() if k in fields})


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """Where an engine finds one bucket's bytes."""

    transport: str
    """"http": `data` holds the bytes; "broadcast": the engine receives them
    from the group (its receive call runs while the trainer broadcasts);
    "shm": in slot `slot` of the link's segment; "disk": nothing per bucket,
    the engine loads the version directory at commit."""
    data: Any = field(default=None, repr=False)
    """http: a 1-d uint8 tensor or bytes-like with the packed bucket."""
    slot: int | None = None
    """shm: the slot index."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, without `data` (bytes travel in a request body of their own)."""
        return {k: v for k, v in self.__dict__.items() if v is not None and k != "data"}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Delivery:
        known = set(cls.__dataclass_fields__) - {"data"}
        return cls(**{k: v for k, v in d.items() if k in known})
