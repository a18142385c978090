"""Which host an address belongs to (`is_local_host`), and which of this host's addresses faces it
(`local_address_towards`).

Answered from the socket layer alone: no packet is sent (a UDP `connect` only picks a route, a
`bind` only checks an address is assigned here), in the calling process's network namespace (two
namespaces are two hosts). Called by the multi-host paths: a gloo rank binds the address its peers
can reach (`formats.groups`), and the coordinator asks before offering shared memory.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

_ROUTE_PROBE_PORT = 9
"""Any port: connecting a UDP socket sends nothing, it only selects the route."""


def _addresses(host: str) -> list[tuple[socket.AddressFamily, str]]:
    """(family, address) for every address `host` resolves to (an IP literal resolves to itself)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve host {host!r}: {e}") from e
    return list(dict.fromkeys((family, str(info[0])) for family, _, _, _, info in infos))


def is_loopback(host: str) -> bool:
    """`host` is a loopback address or resolves only to loopback addresses ("localhost")."""
    try:
        return all(ipaddress.ip_address(address).is_loopback for _, address in _addresses(host))
    except ValueError:
        return False


def local_address_towards(host: str) -> str:
    """This host's address on the route to `host` (its first resolved address);
    `host` itself when it is loopback."""
    family, address = _addresses(host)[0]
    if ipaddress.ip_address(address).is_loopback:
        return address
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, _ROUTE_PROBE_PORT))
        except OSError as e:
            raise ValueError(f"no route from this host to {host!r} ({address}): {e}") from e
        return str(probe.getsockname()[0])


def is_local_host(host: str) -> bool:
    """Every address `host` resolves to is loopback or assigned to an interface of this host."""
    for family, address in _addresses(host):
        if ipaddress.ip_address(address).is_loopback:
            continue
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((address, 0))
            except OSError:
                return False
    return True


def url_host(url: str) -> str | None:
    """The host part of `url` ("http://10.0.0.2:30000" -> "10.0.0.2"), None if it has none."""
    return urlsplit(url).hostname


def check_reachable(engines: Sequence[tuple[str, str | None, Sequence[str]]], *, transport: str,
                    same_host_only: bool, trainer_address: str | None) -> None:
    """Refuse, naming what works, an engine on another host where `transport` works on one
    host only (`same_host_only`: shm) or engines reach the trainer at `trainer_address`, a
    loopback address (a broadcast group's store).

    `engines`: (label, url or None where it runs in this process, the transports it takes
    that work across hosts). An engine whose host does not resolve is left to fail when
    contacted.
    """
    on_loopback = trainer_address is not None and is_loopback(trainer_address)
    if not (same_host_only or on_loopback):
        return
    for label, url, across_hosts in engines:
        host = url_host(url) if url is not None else None
        try:
            if host is None or is_local_host(host):
                continue
        except ValueError:
            continue
        if same_host_only:
            raise ValueError(
                f"{label} is on another host ({host} is not an address of this host), and "
                f"transport={transport!r} reaches engines on the trainer's host only; use one "
                f"of {', '.join(across_hosts)} (disk: a directory both hosts see; broadcast: master_address= an "
                "address of this host the engine reaches)")
        try:
            towards = f"master_address={local_address_towards(host)!r} (this host's address on the route to {host})"
        except ValueError:
            towards = "master_address= an address of this host"  # no route from here: name none
        raise ValueError(f"{label} is on another host and cannot reach master_address={trainer_address!r}, this "
                         f"host's loopback: pass {towards} or another address of this host the engine reaches")
