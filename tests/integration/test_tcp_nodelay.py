"""Both ends of every weightsync HTTP connection run with TCP_NODELAY.

Without it, a request or answer written in two pieces (headers, then body)
waits on the peer's delayed ACK: about 40 ms per call, 8x the whole LoRA push
of the demo on the base install (issue 12). The check reads the socket option
itself, so it does not depend on timing.

The server is built exactly as `weightsync serve` builds it (`bind_socket` and
`make_server`), on the stack of the base install (asyncio + h11) and on the
one uvicorn picks in this environment ("auto": uvloop and httptools when the
test extras are installed). Its end of a connection is found among this
process's file descriptors by address.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from weightsync.engines.json_client import JsonClient
from weightsync.server.serving import bind_socket, make_server, url_of


def nodelay(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


@contextlib.contextmanager
def served(loop: str, http: str) -> Iterator[str]:
    """A one-route app served as `weightsync serve` serves, on a thread; yields its URL."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/echo")
    def echo(body: dict[str, int]) -> dict[str, int]:
        return body

    sock = bind_socket("127.0.0.1", 0)
    server = make_server(app, loop=loop, http=http)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-under-test")
    thread.start()  # the socket already listens: clients may connect before the loop runs
    try:
        yield url_of(sock, "127.0.0.1")
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def server_end(client_sock: socket.socket) -> socket.socket:
    """This process's socket at the other end of `client_sock` (a duplicate; close it)."""
    want = (client_sock.getpeername(), client_sock.getsockname())
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            candidate = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # not a socket, or already closed
        try:
            if candidate.type == socket.SOCK_STREAM and (candidate.getsockname(), candidate.getpeername()) == want:
                return candidate
        except OSError:
            pass  # a listening or unconnected socket has no peer
        candidate.close()
    raise AssertionError(f"no socket of this process is connected to {want[1]}")


@pytest.mark.parametrize(("loop", "http"), [("asyncio", "h11"), ("auto", "auto")],
                         ids=["base-install", "this-environment"])
def test_both_ends_of_a_client_connection_set_tcp_nodelay(loop: str, http: str) -> None:
    with served(loop, http) as url:
        client = JsonClient(url, timeout_s=30)
        try:
            response = client.request("POST", "/echo", json_body={"x": 1})
            assert response.json() == {"x": 1}
            client_sock = response.extensions["network_stream"].get_extra_info("socket")
            assert nodelay(client_sock), "the client's socket has Nagle's algorithm on"
            with server_end(client_sock) as accepted:
                assert nodelay(accepted), f"the server's accepted socket has Nagle's algorithm on ({loop}, {http})"
        finally:
            client.close()


def test_json_client_counts_every_request() -> None:
    """`num_requests` counts every request sent, answered or refused."""
    with served("asyncio", "h11") as url:
        client = JsonClient(url, timeout_s=30)
        try:
            assert client.num_requests == 0
            client.post("/echo", {"x": 1})
            client.request("GET", "/missing", allow=(404,))
            assert client.num_requests == 2
        finally:
            client.close()
