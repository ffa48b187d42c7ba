"""Waiting on sockets a server is expected to close, for the connection-limit tests
(tests/engines/test_http_serving.py, tests/agents/test_proxy_limits.py)."""

from __future__ import annotations

import select
import socket
import time


def closed_by_server(sockets: list[socket.socket], expected: int, wait_s: float) -> list[int]:
    """The indices of `sockets` the server has closed, once `expected` of them are (or `wait_s`
    passed). A closed socket must have been answered nothing: it was only closed."""
    closed: set[int] = set()
    deadline = time.monotonic() + wait_s
    while len(closed) < expected and time.monotonic() < deadline:
        readable, _, _ = select.select([s for i, s in enumerate(sockets) if i not in closed], [], [], 0.1)
        for sock in readable:
            try:
                data = sock.recv(1)
            except ConnectionResetError:
                data = b""
            assert data == b"", data
            closed.add(sockets.index(sock))
    return sorted(closed)
