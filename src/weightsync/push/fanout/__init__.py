"""How a push fans out to the engines: one strategy per module behind `base.FanOut`,
chosen once when the `WeightSync` is built (`make_fan_out`), so the coordinator
(`push.sync`, `push.replicas`) reads the same for every one.

    direct   the trainer sends every engine every bucket          (direct.py)
    relay    the first engine takes each bucket and forwards it
             along the others (over http, or in a broadcast group:
             relay_chain.py)                                        (relay.py)
    shares   `send_shares=True`: every trainer rank sends its own
             share of each bucket, routed by direct or relay       (shares.py)

To add a fan-out: a module with a `FanOut` class and a line in `_FAN_OUTS` below.
"""

from __future__ import annotations

import importlib

from weightsync.push.fanout.base import FanOut
from weightsync.push.fanout.shares import SharesFanOut

_FAN_OUTS: dict[str, str] = {
    "direct": "weightsync.push.fanout.direct:DirectFanOut",
    "relay": "weightsync.push.fanout.relay:RelayFanOut",
}
"""`SyncConfig.fan_out` -> "module:Class" of its strategy."""

FAN_OUTS: tuple[str, ...] = tuple(_FAN_OUTS)
"""How a push reaches several engines (`SyncConfig.fan_out`)."""


def check_fan_out(name: str) -> None:
    """ValueError for a `fan_out` that names no strategy, listing those that do."""
    if name not in _FAN_OUTS:
        raise ValueError(f"unknown fan_out {name!r}; one of {', '.join(FAN_OUTS)}")


def make_fan_out(name: str, *, transport: str, send_shares: bool, mode: str, sends_shares: bool,
                 digest_algorithm: str | None, commit: str = "staged") -> FanOut:
    """The strategy `fan_out=name` names over transport `transport` (its name), wrapped in
    `SharesFanOut` where every trainer rank sends its own shares (`send_shares`, which
    refuses a `mode` whose `sends_shares` is False and a `digest_algorithm` that cannot
    be combined). A streamed `commit` takes the direct fan-out alone (a relaying or
    assembling engine forwards or assembles staged buckets)."""
    check_fan_out(name)
    if commit == "streamed" and (name != "direct" or send_shares):
        raise ValueError(f"commit='streamed' sends every bucket to every engine directly; it does not go with "
                         f"fan_out={name!r}{' and send_shares=True' if send_shares else ''}: use fan_out='direct' "
                         "without send_shares, or commit='staged'")
    module_name, class_name = _FAN_OUTS[name].split(":")
    route: FanOut = getattr(importlib.import_module(module_name), class_name)(transport=transport)
    if not send_shares:
        return route
    return SharesFanOut(route, transport=transport, mode=mode, sends_shares=sends_shares,
                        digest_algorithm=digest_algorithm)


__all__ = ["FAN_OUTS", "FanOut", "check_fan_out", "make_fan_out"]
