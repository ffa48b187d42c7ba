"""Serving an ASGI app with uvicorn under limits one client cannot exhaust: the engine server,
the elastic REST API and the agent proxy all listen through here.

uvicorn's own limits do not fit a listener on a shared cluster: `limit_concurrency` answers 503
once N sockets are open, so N idle sockets from anyone who reaches the port refuse the job's own
requests, and an idle or half-sent connection is held for ever. `limited_protocol` is uvicorn's
h11 protocol with these limits (`ServingLimits`):

- **a request deadline**: the request line, the headers and the body must have arrived within
  `request_timeout_s` of the connection opening, or of the previous reply on a keep-alive
  connection; past it the connection is closed (an idle keep-alive connection ends then too);
- **a cap per peer address** on connections that have not shown the server's bearer token
  (`trusts`): a new connection past it closes that peer's oldest such connection, so one
  peer's idle sockets cannot fill the server, and a new connection always gets its chance;
- **a total cap**: past it, a 503 with `Retry-After` from the protocol, before anything is read;
- **lingering close**: a reply sent before its request's body was read (401, 413) says
  `Connection: close` (`CloseWhenBodyUnread`, so a keep-alive client does not reuse it),
  half-closes the connection and reads and drops the rest, up to LINGER_BYTES within the
  deadline, so the client reads the refusal instead of a reset;
- a `Content-Length` that is not a byte count reaches the app as `x-invalid-content-length`
  (h11 would answer it with a plain-text 400), so the app's own message explains it.

    config = uvicorn_config(app, ServingLimits(), trusts=bearer_trust(token), busy_body=...)
    with UvicornThread(config, "127.0.0.1", 0, "the engine server") as server:   # own socket
        print(server.port)

Tests: tests/engines/test_http_serving.py (real sockets against a real server).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from relax_hpc.auth import bearer_matches

__all__ = [
    "CloseWhenBodyUnread",
    "INVALID_LENGTH_HEADER",
    "LINGER_BYTES",
    "ServingLimits",
    "ServingError",
    "UvicornThread",
    "bearer_trust",
    "json_reply",
    "limited_protocol",
    "listen",
    "uvicorn_config",
]

log = logging.getLogger(__name__)

# At most this much of a refused body is read and dropped after the reply.
LINGER_BYTES = 64 * 1024 * 1024
REFUSED_LINGER_S = 1.0  # a connection answered 503 is read for this long at most, then closed
MAX_HEAD_BYTES = 64 * 1024  # request line and headers held back until complete (h11 refuses more)
INVALID_LENGTH_HEADER = "x-invalid-content-length"
_HEAD_END = re.compile(rb"\r?\n\r?\n")


@dataclass(frozen=True)
class ServingLimits:
    """What one client may hold of a server (`limited_protocol`)."""

    request_timeout_s: float = 30.0  # headers and body must arrive within this; idle keep-alive ends after it
    max_connections: int = 64  # open connections in all; the next one is answered 503
    max_untrusted_per_peer: int = 16  # connections of one address without the token yet; the oldest goes

    def __post_init__(self) -> None:
        problems = []
        timeout = self.request_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
                or timeout <= 0:
            problems.append(f"request_timeout_s must be a number of seconds > 0, got {timeout!r}")
        for name in ("max_connections", "max_untrusted_per_peer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be an integer >= 1, got {value!r}")
        if problems:
            raise ValueError("server limits: " + "; ".join(problems))


def bearer_trust(token: str) -> Callable[[str | None], bool]:
    """The trust test of a server whose token is `token`: the Authorization header carries it."""
    return lambda header: bearer_matches(header, token)


def json_reply(status: int, reason: str, payload: Any, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response with a JSON body that closes the connection."""
    body = json.dumps(payload).encode("utf-8")
    lines = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}",
             *(f"{k}: {v}" for k, v in (headers or {}).items()), "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _mark_invalid_lengths(head: bytes) -> bytes:
    """`head` with every Content-Length that is not 1 to 18 ASCII digits renamed, so h11 reads no body
    and the app can answer with its own message."""
    lines = head.split(b"\n")
    for i, line in enumerate(lines[1:], 1):
        name, sep, value = line.partition(b":")
        text = value.strip()
        if sep and name.strip().lower() == b"content-length" and not (text.isdigit() and len(text) <= 18):
            lines[i] = INVALID_LENGTH_HEADER.encode() + b":" + value
    return b"\n".join(lines)


class _Connections:
    """The open connections of one server, and per peer address those not trusted yet (oldest first).
    Touched only from the server's event loop."""

    def __init__(self) -> None:
        self.open: set[Any] = set()
        self.untrusted: dict[str, list[Any]] = {}

    def forget_untrusted(self, conn: Any) -> None:
        mine = self.untrusted.get(conn.peer)
        if mine is not None and conn in mine:
            mine.remove(conn)
            if not mine:
                del self.untrusted[conn.peer]


class _LingeringTransport:
    """The transport uvicorn sees: `close()` goes through the protocol, which may linger."""

    def __init__(self, transport: asyncio.Transport, protocol: LimitedH11Protocol) -> None:
        self._transport, self._protocol = transport, protocol
        self._closing = False

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._protocol.close_after_reply()

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under `ServingLimits` (module docstring); `limited_protocol` makes the
    class of one server, with its limits, trust test, 503 reply and connection table."""

    serving_limits: ServingLimits
    trusts: Callable[[str | None], bool]
    busy_reply: bytes
    table: _Connections

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.raw, self.peer = transport, _peer_of(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._refused = self._lingering = self._trusted = self._eof = False
        self._linger_left, self._head, self._seen_cycle = LINGER_BYTES, b"", None
        limits, table = self.serving_limits, self.table
        mine = table.untrusted.get(self.peer, [])
        if len(mine) >= limits.max_untrusted_per_peer:
            mine[0].drop()  # the peer's oldest connection that never showed the token
        if len(table.open) >= limits.max_connections:
            self._refused = True
            transport.write(self.busy_reply)
            self._linger(REFUSED_LINGER_S)
            return
        table.open.add(self)
        table.untrusted.setdefault(self.peer, []).append(self)
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        self._arm(limits.request_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._refused or self._lingering:
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self.drop()
            return
        before = self.conn.their_state
        if before is h11.IDLE:  # hold the head back until it is whole, to check its Content-Length
            data = self._head + data
            end = _HEAD_END.search(data)
            if end is None and len(data) < MAX_HEAD_BYTES:
                self._head = data
                return
            self._head = b""
            if end is not None:
                data = _mark_invalid_lengths(data[: end.end()]) + data[end.end():]
        super().data_received(data)
        self._after_events(before)

    def _after_events(self, before: Any) -> None:
        cycle = self.cycle
        if cycle is not None and cycle is not self._seen_cycle:
            self._seen_cycle = cycle
            if not self._trusted and self.trusts(_authorization(cycle.scope["headers"])):
                self._trusted = True
                self.table.forget_untrusted(self)
        state = self.conn.their_state
        if state is h11.DONE:
            self._cancel_timer()  # the request is in: the app's time is not the client's
        elif state is h11.IDLE and before is not h11.IDLE and not self.raw.is_closing():
            self._arm(self.serving_limits.request_timeout_s)  # a drained body: the next request's deadline

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.raw.is_closing() or self._lingering:
            return
        if self._eof:
            self.drop()
        elif self.conn.their_state in (h11.IDLE, h11.DONE):
            self._arm(self.serving_limits.request_timeout_s)  # the wait for the next request
        else:  # SEND_BODY: answered before its body was read (401, 413): the reply, EOF, the rest dropped
            self._linger(None)

    def eof_received(self) -> bool | None:
        self._eof = True
        if self._refused or self._lingering or self.cycle is None or self.cycle.response_complete:
            return None  # the transport closes
        if self.conn.their_state is h11.SEND_BODY:  # the body ended early: the app reads what came
            self.cycle.more_body = False
            self.cycle.message_event.set()
        return True  # keep the way back open for the reply

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self._forget()
        if not self._refused:
            super().connection_lost(exc)

    def close_after_reply(self) -> None:
        """uvicorn closes the connection: linger when the client may still be sending a body."""
        if self.raw.is_closing():
            return
        if self._eof or self.conn.their_state is not h11.SEND_BODY:
            self.drop()
        else:
            self._linger(None)

    def drop(self) -> None:
        """Close now, without reading more."""
        self._forget()
        self._cancel_timer()
        self.raw.close()

    def _linger(self, timeout_s: float | None) -> None:
        self._lingering = True
        try:
            self.raw.write_eof()  # after what is buffered: the client reads the reply, then EOF
            self.raw.resume_reading()
        except (OSError, RuntimeError, NotImplementedError):
            self.drop()
            return
        if timeout_s is not None or self._timer is None:
            self._arm(timeout_s if timeout_s is not None else self.serving_limits.request_timeout_s)

    def _arm(self, timeout_s: float) -> None:
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self.drop)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _forget(self) -> None:
        self.table.open.discard(self)
        self.table.forget_untrusted(self)


def _peer_of(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


def _authorization(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


def limited_protocol(limits: ServingLimits, trusts: Callable[[str | None], bool] | None,
                     busy_body: Any) -> type[LimitedH11Protocol]:
    """The protocol class of one server: its limits, its trust test (None: nothing is trusted, so
    the per-peer cap counts every connection) and the JSON body of its 503."""
    message = f"{limits.max_connections} connections are open, this server's limit; retry later"
    reply = json_reply(503, "Service Unavailable", busy_body if busy_body is not None else {"error": message},
                       {"Retry-After": "1"})
    attributes = {"serving_limits": limits, "trusts": staticmethod(trusts or (lambda header: False)),
                  "busy_reply": reply, "table": _Connections()}
    return type("ServerProtocol", (LimitedH11Protocol,), attributes)


class CloseWhenBodyUnread:
    """ASGI wrapper: a reply that starts before its request's body has been read whole (a 401
    from the headers alone, a 413 from the Content-Length) says `Connection: close`.

    The protocol closes such a connection after the reply (the lingering close above); without
    the header a keep-alive client puts it back in its pool and may send its next request down
    it before the close arrives, and gets no reply at all ("Server disconnected without sending
    a response") instead of the refusal."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        names = {name.lower() for name, _ in scope["headers"]}
        lengths = [value for name, value in scope["headers"] if name.lower() == b"content-length"]
        read_whole = b"transfer-encoding" not in names and all(v.strip() == b"0" for v in lengths)

        async def tracked_receive() -> Any:
            nonlocal read_whole
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                read_whole = True
            return message

        async def guarded_send(message: Any) -> None:
            if message["type"] == "http.response.start" and not read_whole:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"connection" for name, _ in headers):
                    message = {**message, "headers": [*headers, (b"Connection", b"close")]}
            await send(message)

        await self.app(scope, tracked_receive, guarded_send)


def uvicorn_config(app: Any, limits: ServingLimits, *, trusts: Callable[[str | None], bool] | None,
                   busy_body: Any = None, shutdown_timeout_s: float = 5.0) -> uvicorn.Config:
    """uvicorn's Config for `app` under `limits` (the caller binds the socket)."""
    return uvicorn.Config(CloseWhenBodyUnread(app), http=limited_protocol(limits, trusts, busy_body),
                          log_level="warning",
                          lifespan="off", access_log=False, ws="none",
                          timeout_keep_alive=max(1, math.ceil(limits.request_timeout_s)),
                          timeout_graceful_shutdown=max(1, round(shutdown_timeout_s)))


class ServingError(RuntimeError):
    """A server could not start listening; the message says where and why."""


def listen(host: str, port: int, who: str) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        hint = "pick another port, or 0 for a free one" if port else "check that the host is an address of this machine"
        raise ServingError(f"{who} cannot listen on {host}:{port}: {e}; {hint}") from None


class UvicornThread:
    """Runs a uvicorn Config in a daemon thread on a socket of its own: the socket is bound at
    construction or passed in as `sock` (a port in use fails there, `.port` is known at once), `start()` returns once
    uvicorn serves, `stop()` closes the port and joins the thread (safe without start, and twice)."""

    def __init__(self, config: uvicorn.Config, host: str, port: int, who: str, *,
                 start_timeout_s: float = 30.0, shutdown_timeout_s: float = 5.0,
                 sock: socket.socket | None = None) -> None:
        self.host, self.who, self.start_timeout_s = host, who, start_timeout_s
        self._socket = sock if sock is not None else listen(host, port, who)
        self.port: int = self._socket.getsockname()[1]
        self._server = uvicorn.Server(config)
        self._shutdown_timeout_s = shutdown_timeout_s
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def start(self) -> Self:
        if self._thread is not None:
            raise RuntimeError(f"{self.who} was already started; make a new one to serve again")
        self._thread = threading.Thread(target=self._run, name=f"relax-http-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                self._socket.close()
                raise ServingError(f"{self.who} on {self.host}:{self.port} stopped while starting: "
                                   f"{self._failure!r}; the log above has uvicorn's message")
            if time.monotonic() > deadline:
                self.stop()
                raise ServingError(f"{self.who} on {self.host}:{self.port} did not start within "
                                   f"{self.start_timeout_s} s; the log above has uvicorn's messages")
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except (Exception, SystemExit) as e:  # uvicorn exits with SystemExit on start-up failures
            self._failure = e
            log.exception("%s on %s:%s stopped", self.who, self.host, self.port)

    @property
    def open_connections(self) -> int:
        """Connections the server holds now (those answered 503 not counted)."""
        protocol = self._server.config.http
        limited = isinstance(protocol, type) and issubclass(protocol, LimitedH11Protocol)
        return len(protocol.table.open) if limited else 0

    def join(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the server thread to end; whether it has."""
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Stop listening, finish or cut open requests, join the thread."""
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join(self._shutdown_timeout_s + 5)
            if self._thread.is_alive():  # a request still running past the graceful window
                self._server.force_exit = True
                self._thread.join(5)
                if self._thread.is_alive():
                    log.warning("%s thread on port %s did not stop; it is a daemon and ends with the process",
                                self.who, self.port)
        self._socket.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
