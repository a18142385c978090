"""One helper for fixtures that run a real `weightsync serve` (importable from every
test directory: pytest puts tests/, the directory of the root conftest.py, on sys.path)."""

from __future__ import annotations

from collections.abc import Iterator

from weightsync.server.launch import ServerProcess


def checked(server: ServerProcess) -> Iterator[ServerProcess]:
    """For a fixture (`yield from checked(launch_server(...))`): yields `server`, stops it,
    and fails if it logged a traceback (an unanticipated error, a 500)."""
    try:
        yield server
        log = server.log_text()
    finally:
        server.close()
    assert "Traceback" not in log, f"the server logged an unhandled error (a 500?):\n{log[-4000:]}"
