"""A local HTTP endpoint that records Apprise's JSON notifications (its json:// scheme).

    with json_endpoint() as endpoint:
        notifier = AppriseNotifier([endpoint.url()], ...)
        ...
        posts = endpoint.wait_for(1)   # [{"path", "headers", "title", "message", ...}]

Shared by tests/ops/test_notify.py and tests/driver/test_notify_run.py.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class JsonEndpoint:
    """What the local endpoint received; ``release`` gates the answers (set: answer at once)."""

    port: int = 0
    posts: list[dict[str, Any]] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)
    release: threading.Event = field(default_factory=threading.Event)

    def url(self, path: str = "hook", auth: str = "") -> str:
        return f"json://{auth}127.0.0.1:{self.port}/{path}"

    def wait_for(self, count: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        with self.arrived:
            self.arrived.wait_for(lambda: len(self.posts) >= count, timeout_s)
            return list(self.posts)


@contextmanager
def json_endpoint() -> Iterator[JsonEndpoint]:
    """A local HTTP server that records Apprise's JSON notifications (path, headers, payload)."""
    endpoint = JsonEndpoint()
    endpoint.release.set()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with endpoint.arrived:
                endpoint.posts.append({"path": self.path, "headers": dict(self.headers), **payload})
                endpoint.arrived.notify_all()
            endpoint.release.wait(60)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    endpoint.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield endpoint
    finally:
        endpoint.release.set()
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
