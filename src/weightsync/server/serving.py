"""Binding the socket and running uvicorn for the embedded engine.

The socket is bound before the model loads, so with port 0 the real port is
known; `on_listening` is called with the URL once the app is ready to accept.

Every accepted connection has TCP_NODELAY. A request or answer goes out in
more than one write (headers, then body); with Nagle's algorithm on, the last
small write waits for the peer's delayed ACK, about 40 ms per HTTP call on
Linux. asyncio sets TCP_NODELAY only on sockets whose protocol is
IPPROTO_TCP, so `bind_socket` names it (uvloop sets it on any TCP socket).
"""

from __future__ import annotations

import gc
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightsync.server.config import ServerConfig

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one.

    The protocol is IPPROTO_TCP, not 0: asyncio's event loop then sets
    TCP_NODELAY on every connection it accepts (see the module docstring).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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


def make_server(app: Any, *, loop: str = "auto", http: str = "auto") -> uvicorn.Server:
    """The uvicorn server `weightsync serve` runs `app` with; start it with
    `.run(sockets=[bind_socket(...)])`.

    `loop` and `http` are uvicorn's choices: "auto" (the CLI) takes uvloop and
    httptools when they are installed and asyncio and h11 otherwise (the base
    install); tests pin them to check both.
    """
    import uvicorn

    return uvicorn.Server(uvicorn.Config(
        app, log_level="warning", lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        access_log=False, loop=loop, http=http,
    ))


def serve(config: ServerConfig, *, on_listening: Callable[[str], None]) -> None:
    """Load the model, serve until SIGINT/SIGTERM, then shut down cleanly."""
    from weightsync.server.app import create_app
    from weightsync.server.state import ServerState

    sock = bind_socket(config.host, config.port)
    try:
        state = ServerState.build(config)
        server = make_server(create_app(state))
        # The model, the tokenizer and the app live as long as the server: leave them out of
        # the collector's full passes, which otherwise walk every module of the model (a
        # 2,500-layer one: half a second) each time a push's tens of thousands of manifest
        # entries trigger one.
        gc.collect()
        gc.freeze()
        on_listening(url_of(sock, config.host))
        server.run(sockets=[sock])
    finally:
        sock.close()
