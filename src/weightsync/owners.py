"""Owner tags for what a trainer leaves on its host while it writes (a disk
version's hidden `.tmp-v*` directory, a shm segment) and for the update
sessions it holds on engines.

A trainer removes both when it finishes, fails or exits; a SIGKILLed one cannot.
Naming them after their writer (`<host id>-<pid>`) lets the next writer on the
same host see that the owner is gone and remove them.

Only a clearly dead owner's leftovers are removed: a tag from another host or
pid namespace (the host id hashes the hostname and the pid namespace) is never
judged, and a pid that exists, even reused by another process, counts as alive.
So a leftover can outlive its owner for a while, but a live writer's files are
never removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path

TAG_PATTERN = r"[0-9a-f]{8}-\d{1,10}"
"""What `owner_tag()` returns, as a regular expression."""


def _host_id() -> str:
    namespace = ""
    with contextlib.suppress(OSError):
        namespace = os.readlink("/proc/self/ns/pid")
    return hashlib.sha256(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]


_HOST_ID = _host_id()


def owner_tag(pid: int | None = None) -> str:
    """`<host id>-<pid>` of this process (or of process `pid` of this host)."""
    return f"{_HOST_ID}-{os.getpid() if pid is None else pid}"


def owner_gone(tag: str) -> bool:
    """True only if `tag` names a process of this host and pid namespace that no longer exists."""
    if not re.fullmatch(TAG_PATTERN, tag):
        return False
    host, _, pid = tag.partition("-")
    if host != _HOST_ID or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def session_owner() -> str:
    """A new trainer identity for update sessions: `<host id>-<pid>/<nonce>` (one per
    `WeightSync`, so two in one process are two owners)."""
    return f"{owner_tag()}/{secrets.token_hex(4)}"


def session_owner_gone(owner: str) -> bool:
    """True only if `owner` (from `session_owner`) is a process of this host and pid
    namespace that no longer exists (see `owner_gone`)."""
    return owner_gone(owner.partition("/")[0])


def orphans(paths: Iterable[Path], pattern: re.Pattern[str]) -> Iterator[Path]:
    """The `paths` whose name matches `pattern` (group 1: an owner tag) and whose owner is gone."""
    for path in paths:
        match = pattern.match(path.name)
        if match and owner_gone(match.group(1)):
            yield path
