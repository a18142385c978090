"""The subcommands that run the tooling in `weightsync_tools` (`weightsync demo`,
`weightsync bench`): it ships beside the library and needs the `tools` extra,
which the library itself never imports."""

from __future__ import annotations

import importlib.util
import sys

TOOLS_REQUIREMENTS = ("weightsync_tools", "matplotlib", "tqdm")
"""What the tooling imports that a base install of weightsync may lack."""
INSTALL_HINT = "pip install 'weightsync[tools]' (from a clone: bash scripts/setup.sh tools)"


def missing_tools() -> list[str]:
    """The modules of `TOOLS_REQUIREMENTS` that cannot be imported here."""
    return [name for name in TOOLS_REQUIREMENTS if importlib.util.find_spec(name) is None]


def tools_installed(command: str) -> bool:
    """True when `weightsync COMMAND` can run; otherwise says what to install, on stderr."""
    missing = missing_tools()
    if missing:
        print(f"error: `weightsync {command}` needs the tools extra ({', '.join(missing)} not installed); "
              f"install it with: {INSTALL_HINT}", file=sys.stderr)
    return not missing
