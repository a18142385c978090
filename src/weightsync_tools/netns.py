"""Hosts made of Linux network namespaces, joined by one switch (a bridge).

    with Network(["trainer", "engine0", "engine1"]) as net:
        net.prefix("engine0"); net.address("engine0"); net.cut("engine0"); net.shape("engine0", rate_bits=10e9)

Creates nothing in the caller's namespace and leaves nothing behind (`close()`, also after a failed
setup). Only the network is separate: hosts share the filesystem, /dev/shm and pids. Used by
tests/multihost and the multi-host benches; the rig in full: docs/TESTING.md ("The multi-host rig").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence

PREFIX = "wsmh"
SUBNET = "10.231.0"
_OURS = re.compile(rf"^{PREFIX}(\d+)-")


class NamespaceError(RuntimeError):
    """An `ip` command failed; carries its stderr."""


def _ip(*args: str, netns: str | None = None) -> str:
    command = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NamespaceError(f"{' '.join(command)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _tc(netns: str, *args: str) -> None:
    command = ["ip", "netns", "exec", netns, "tc", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NamespaceError(f"{' '.join(command)}: {done.stderr.strip()}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def remove_stale() -> None:
    """Delete namespaces an earlier run of this rig left behind (its pid is gone)."""
    for line in _ip("netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _OURS.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


class Network:
    """Hosts (namespaces) on one switch; see the module docstring."""

    def __init__(self, hosts: Sequence[str]) -> None:
        tag = f"{PREFIX}{os.getpid()}"
        self.hosts = list(hosts)
        self.switch = f"{tag}-sw"
        self.namespaces = {h: f"{tag}-{h}" for h in self.hosts}
        self._ports = {h: f"p{i}" for i, h in enumerate(self.hosts)}
        self._addresses = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(self.hosts)}
        self._made: list[str] = []

    def __enter__(self) -> Network:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        self._add_namespace(self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for host in self.hosts:
            ns = self.namespaces[host]
            self._add_namespace(ns)
            port = self._ports[host]
            _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns, netns=self.switch)
            _ip("link", "set", port, "master", "br0", "up", netns=self.switch)
            _ip("addr", "add", f"{self._addresses[host]}/24", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def close(self) -> None:
        """Delete every namespace this network made (their veths and bridge go with them)."""
        while self._made:
            name = self._made.pop()
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)

    # -- using it ------------------------------------------------------------------------------

    def prefix(self, host: str) -> list[str]:
        """The argv prefix that runs a command on `host`."""
        return ["ip", "netns", "exec", self.namespaces[host]]

    def address(self, host: str) -> str:
        return self._addresses[host]

    def cut_command(self, host: str) -> list[str]:
        """The command that takes `host`'s link down (a process on any host may run it)."""
        return ["ip", "netns", "exec", self.switch, "ip", "link", "set", self._ports[host], "down"]

    def cut(self, host: str) -> None:
        _ip("link", "set", self._ports[host], "down", netns=self.switch)

    def restore(self, host: str) -> None:
        _ip("link", "set", self._ports[host], "up", netns=self.switch)

    def shape(self, host: str, *, rate_bits: float, burst_bytes: int = 1 << 20) -> None:
        """Limit `host`'s link to `rate_bits` per second each way (tc tbf on both veth ends)."""
        rate = f"{int(rate_bits)}bit"
        limit = str(max(burst_bytes * 4, 4 << 20))
        for ns, dev in ((self.switch, self._ports[host]), (self.namespaces[host], "eth0")):
            _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst_bytes),
                "limit", limit)

    def unshape(self, host: str) -> None:
        for ns, dev in ((self.switch, self._ports[host]), (self.namespaces[host], "eth0")):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=30)
