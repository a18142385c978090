"""The owner identity of a process of this host that has exited: `weightsync.owners` run in a
child of its own (the module alone, stdlib only: a child importing the package and torch costs
seconds), which prints its `owner_tag()` and a `session_owner()`, then exits and is reaped."""

from __future__ import annotations

import subprocess
import sys

import weightsync.owners

_CODE = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('owners', sys.argv[1]); "
         "owners = importlib.util.module_from_spec(spec); spec.loader.exec_module(owners); "
         "print(owners.owner_tag(), owners.session_owner())")


def gone_owner() -> tuple[str, str]:
    """(owner tag, session owner) of a child process of this host, gone by the time this returns."""
    child = subprocess.run([sys.executable, "-c", _CODE, weightsync.owners.__file__],
                           capture_output=True, text=True, check=True, timeout=60)
    tag, owner = child.stdout.split()
    return tag, owner
