"""Binding the socket and running uvicorn for the embedded engine.

The socket is bound before the model loads, so with port 0 the real port is
known; `on_listening` is called with the URL once the app is ready to accept.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from weightsync.server.config import ServerConfig

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def serve(config: ServerConfig, *, on_listening: Callable[[str], None]) -> None:
    """Load the model, serve until SIGINT/SIGTERM, then shut down cleanly."""
    import uvicorn

    from weightsync.server.app import create_app
    from weightsync.server.state import ServerState

    sock = bind_socket(config.host, config.port)
    try:
        state = ServerState.build(config)
        app = create_app(state)
        server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            access_log=False,
        ))
        on_listening(url_of(sock, config.host))
        server.run(sockets=[sock])
    finally:
        sock.close()
