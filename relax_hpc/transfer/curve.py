"""CURVE keys of the transfer queue, derived from the job secret, and the checks around them.

Only a process holding the job secret can talk to the queue (docs/transfer-queue.md,
"Authentication"):

* the server's socket is a CURVE server whose key pair comes from ``derive("queue/server")``;
  a client must know its public key, so one without the secret cannot even finish the
  handshake;
* the clients' key pair comes from ``derive("queue/client")``; a :class:`ZapHandler` on the
  server's context admits that public key and nothing else, on every endpoint of the server
  (tcp and the same-host ipc:// one);
* a client watches its handshake (:class:`HandshakeWatch`) and turns a refusal into an error
  that names the job secret, instead of waiting for replies that never come.

Every message is then encrypted and authenticated by libzmq (libsodium).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from relax_hpc.auth import SECRET_ENV, JobSecret
from relax_hpc.transfer.queue import TransferQueueError

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # RFC 27: where libzmq asks, per context
ZAP_DOMAIN = "relax-hpc-queue"
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class TransferAuthError(TransferQueueError):
    """The queue server refused this client's credentials: its job secret is not the job's.
    Retrying does not help."""


@dataclass(frozen=True)
class QueueKeys:
    """The queue's two CURVE key pairs (Z85 text, as libzmq takes them)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)


def queue_keys(secret: JobSecret) -> QueueKeys:
    """Both key pairs of the job's queue: each secret key is 32 derived bytes, its public key
    follows from it."""
    server_secret = z85.encode(secret.derive("queue/server"))
    client_secret = z85.encode(secret.derive("queue/client"))
    return QueueKeys(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)


def set_server_keys(sock: zmq.Socket[Any], keys: QueueKeys) -> None:
    """Make ``sock`` a CURVE server (before it binds): every peer must complete the handshake
    and pass the context's ZAP handler."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)


def set_client_keys(sock: zmq.Socket[Any], keys: QueueKeys) -> None:
    """Give ``sock`` the job's client key pair and the server's public key (before it connects)."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


class ZapHandler:
    """Answers libzmq's authentication requests (ZAP, RFC 27) for the sockets of one context:
    a CURVE client with the job's client key is admitted, anyone else refused (status 400).

    Bind it before the server socket binds, and call :meth:`answer_pending` whenever
    :attr:`socket` is readable: libzmq holds each new connection until it has the answer.
    """

    def __init__(self, ctx: zmq.Context[Any], keys: QueueKeys) -> None:
        self._allowed = z85.decode(keys.client_public)
        self.refused = 0
        self.socket: zmq.Socket[Any] = ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)

    def answer_pending(self) -> None:
        while True:
            try:
                request = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.socket.send_multipart(self._answer(request))

    def close(self) -> None:
        self.socket.close(0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # version, request id, domain, peer address, routing id, mechanism, credentials...
        if len(request) < 6:
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism, *credentials = request
        if mechanism == b"CURVE" and credentials and credentials[0] == self._allowed:
            return [version, request_id, b"200", b"OK", b"queue-client", b""]
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood stays quiet
            log.warning(
                "transfer queue: refused a %s client from %s (%d refused so far): its key is not "
                "derived from this job's secret",
                mechanism.decode(errors="replace"), address.decode(errors="replace"), self.refused,
            )
        return [version, request_id, b"400", b"not a client of this job", b"", b""]


class HandshakeWatch:
    """Reports how the CURVE handshakes of a client socket end (a socket monitor); create it
    before the socket connects, :meth:`close` it once connected."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._sock = sock
        self._monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS)

    def wait(self, endpoint: str, timeout: float) -> str | None:
        """Wait for the handshake on ``endpoint`` (matched by transport: a tcp host name is
        reported resolved). Returns "ok", None when nothing was heard within ``timeout``
        (no server there), or why the server refused."""
        scheme = endpoint.split("://", 1)[0].encode() + b"://"
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self._monitor.poll(math.ceil(left * 1000)):
                break
            event = parse_monitor_message(self._monitor.recv_multipart())
            if not bytes(event["endpoint"]).startswith(scheme):
                continue
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "ok"
            return _refusal(event["event"], int(event["value"]))
        return None

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)


def _refusal(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"its authenticator answered status {value}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "it does not use CURVE: is it an older relax-hpc, or not a queue server?"
        return f"ZMTP protocol error {value:#x} during the CURVE handshake"
    return "it closed the connection during the CURVE handshake"


def refused_message(address: str, why: str) -> str:
    """The error of a client whose handshake the server refused."""
    path = os.environ.get(SECRET_ENV)
    where = f"it is {path}" if path else "it is not set"
    return (
        f"transfer queue at {address} refused this client's credentials ({why}): this process's job "
        f"secret is not the one the queue server was started with. Every process of a job must load the "
        f"job's secret: point {SECRET_ENV} at this job's JOBDIR/.secret ({where}), and start the "
        "process through `relax-hpc run` or the job script"
    )
