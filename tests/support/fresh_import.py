"""What a fresh interpreter imports for `import weightsync` and for `python -m weightsync --help`,
run once per pytest session and shared by the tests that check it (each fresh interpreter costs
seconds of torch imports)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import weightsync

SRC = Path(weightsync.__file__).parent.parent

_CODE = """
import contextlib, io, json, runpy, sys
import torch
with_torch = set(sys.modules)
import weightsync
after_import = sorted(sys.modules)
out = io.StringIO()
sys.argv = ["weightsync", "--help"]
code = None
with contextlib.redirect_stdout(out):
    try:
        runpy.run_module("weightsync", run_name="__main__", alter_sys=True)  # what `python -m` runs
    except SystemExit as e:
        code = e.code
print(json.dumps({"after_import": after_import, "added_by_weightsync": sorted(set(sys.modules) - with_torch),
                  "after_help": sorted(sys.modules), "help": out.getvalue(), "help_exit": code}))
"""


@dataclass(frozen=True)
class FreshImport:
    after_import: list[str]
    """sys.modules after `import torch; import weightsync`."""
    added_by_weightsync: list[str]
    """What `import weightsync` and `python -m weightsync --help` add after `import torch`."""
    after_help: list[str]
    """sys.modules after `python -m weightsync --help` ran too."""
    help: str
    """What `--help` printed."""
    help_exit: int | str | None
    """Its SystemExit code (argparse's --help: 0)."""


@functools.cache
def fresh_import() -> FreshImport:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return FreshImport(**json.loads(done.stdout.splitlines()[-1]))
