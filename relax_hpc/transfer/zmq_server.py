"""ZMQ transfer queue server: a ROUTER socket (two with sealed sessions), one event-loop thread,
state in memory.

The driver runs it (a background thread by default); clients
(:class:`~relax_hpc.transfer.zmq_client.TransferQueueClient`) talk to it with DEALER sockets.
Requests that cannot be answered yet (a get waiting for rows, a put against a full queue, a
staleness wait) are parked and answered when a later request changes the state, or with a
timeout error at their deadline: the loop itself never blocks on one client (what each op
does to the queue: :mod:`relax_hpc.transfer.zmq_ops`). Stored tensors stay as the received
frames and are re-sent zero-copy. A malformed message gets an error reply and is otherwise
ignored; what one request may cost is bounded before it is decoded
(:mod:`relax_hpc.transfer.limits`).

A client that vanishes leaves no parked request behind: ZMQ heartbeats close the connection of
a silent peer, and every ``heartbeat_s`` the server drops the parked requests whose peer ROUTER
no longer knows (:meth:`TransferQueueServer._drop_vanished`; why a probe rather than the socket
monitor: docs/transfer-queue.md, "Limits").

Only the job's processes get in: the socket is a CURVE server with keys derived from the job
secret, and a ZAP handler answered by the same loop admits only the job's client key, on the
tcp and the ipc:// endpoint alike (:mod:`relax_hpc.transfer.curve`). A session's consumer id
is fixed by its first request (:mod:`relax_hpc.transfer.sessions`). With ``payload`` "encrypt"
or "authenticate" a second, plain ROUTER socket takes a TCP client's sealed messages, under the
key its CURVE ping reply carried (:mod:`relax_hpc.transfer.sealed_socket`); a reply goes back
on the route its request came by.

Same-host clients move payloads through shared memory instead (see
:mod:`relax_hpc.transfer.shm`): the server advertises its host id and shm directory in the ping
reply, stores only the references a put/write carries, and deletes the payload files when the
partition is cleared and on stop. A get from a client that cannot see the directory (header
field ``m`` absent or false) is answered with the bytes inlined as frames.

Run standalone: ``python -m relax_hpc.transfer.zmq_server --bind tcp://0.0.0.0:0 --capacity N``
(prints the address to connect to, serves until interrupted; the job secret comes from
``RELAX_HPC_SECRET_FILE``).
"""

from __future__ import annotations

import argparse
import logging
import socket as pysocket
import threading
import time
from collections import OrderedDict
from typing import Any

import zmq

from relax_hpc.auth import JobSecret, job_secret
from relax_hpc.transfer.curve import ZapHandler, queue_keys, set_server_keys
from relax_hpc.transfer.limits import (
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    HEARTBEAT_S,
    HEARTBEAT_TIMEOUT_S,
)
from relax_hpc.transfer.queue import TransferQueueError
from relax_hpc.transfer.seal import SEALED_MODES, TAG_BYTES, PayloadMode, SealError
from relax_hpc.transfer.sealed_socket import PlainRoute, Route, SealedRoute, SessionKeys
from relax_hpc.transfer.sessions import ConsumerMismatchError, SessionConsumers
from relax_hpc.transfer.shm import ShmStore, shm_enabled_by_env
from relax_hpc.transfer.state import QueueState
from relax_hpc.transfer.wire import WIRE_VERSION, Encoded, WireError, arg, pack_header, unpack_header
from relax_hpc.transfer.zmq_ops import Handler, QueueOps, Refused, Request

log = logging.getLogger(__name__)

MAX_SESSIONS_REMEMBERED = 4096
# Replies kept per session for retries. A client names in each request (header 'r') its oldest
# request still unanswered; older replies are dropped. Clients keep at most MAX_IN_FLIGHT
# (zmq_client.py) requests unanswered, far below this bound.
MAX_REPLIES_PER_SESSION = 64
MAX_SESSION_LEN = 128  # session ids key the reply cache; clients send 32 hex digits
MAX_ERROR_CHARS = 2000  # an error reply quotes the request: it stays small
# Sent to the peer of a parked request to learn whether it is still connected; clients drop
# any message whose id matches no request of theirs.
PROBE = pack_header({"id": None, "probe": True})



class TransferQueueServer:
    """Serve a transfer queue on ``address`` (``tcp://host:0`` picks a free port).

    ``secret``: the job secret; only clients built with the same one get in (CURVE keys derived
    from it, see :mod:`relax_hpc.transfer.curve`).
    ``shm``: offer the same-host shared-memory path (None: on unless ``RELAX_TQ_SHM=0``; it is
    also off when ``shm_root`` does not exist). ``shm_root``: where the per-server directory
    ``relax-tq-<id>`` is created. ``max_frame_bytes``: the largest frame a peer may send
    (``zmq.MAXMSGSIZE``: a larger one drops the connection before the server reads it);
    ``max_header_bytes``: the largest request header. ``heartbeat_s``: ZMQ heartbeat interval,
    and how often parked requests of vanished clients are looked for; a peer silent for
    ``heartbeat_timeout_s`` is disconnected. See docs/transfer-queue.md, "Limits".
    ``payload``: "curve" (every message on the CURVE socket), or "encrypt" / "authenticate": a
    TCP client's session gets a key with its ping reply and sends the rest on a second, plain
    socket, each message sealed with AES-256-GCM, or its frames tagged with AES-GMAC
    (:mod:`relax_hpc.transfer.seal`; docs/transfer-queue.md, "Authentication").
    """

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:0",
        capacity: int | None = None,
        *,
        secret: JobSecret,
        poll_interval_s: float = 0.05,
        shm: bool | None = None,
        shm_root: str = "/dev/shm",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        heartbeat_s: float = HEARTBEAT_S,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        payload: PayloadMode = "curve",
    ) -> None:
        if payload not in ("curve", *SEALED_MODES):
            raise ValueError(f"payload must be 'curve', 'encrypt' or 'authenticate'; got {payload!r}")
        if max_frame_bytes < 1 or max_header_bytes < 1 or not 0 < heartbeat_s <= heartbeat_timeout_s:
            raise ValueError(
                f"need max_frame_bytes >= 1, max_header_bytes >= 1 and 0 < heartbeat_s <= heartbeat_timeout_s; "
                f"got {max_frame_bytes}, {max_header_bytes}, {heartbeat_s}, {heartbeat_timeout_s}"
            )
        self._bind = address
        # Sealed sessions: the CURVE handshake hands out a key, the data socket carries the rest.
        self._session_keys = SessionKeys(payload, MAX_SESSIONS_REMEMBERED) if payload in SEALED_MODES else None
        self._data_port: int | None = None
        self._unopened = 0  # messages on the data socket that did not open (dropped)
        self._sealed_sessions = 0  # sessions that sent at least one sealed message
        self._keys = queue_keys(secret)
        self._sessions = SessionConsumers()
        self._want_shm = shm_enabled_by_env() if shm is None else shm
        self._shm_root = shm_root
        self._shm: ShmStore | None = None
        self._ipc: str | None = None  # same-host endpoint, bound next to the shm directory
        self._state: QueueState[Encoded] = QueueState(capacity)
        self._max_frame_bytes = max_frame_bytes
        self._max_header_bytes = min(max_header_bytes, max_frame_bytes)
        self._heartbeat_s = heartbeat_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._poll_interval_s = poll_interval_s
        self._parked: list[Request] = []
        self._queue_ops = QueueOps(self._state, self._parked)
        # session -> request id -> reply frames (None while the request is parked)
        self._replies: OrderedDict[str, OrderedDict[int, list[Any] | None]] = OrderedDict()
        self._address: str | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._handlers = self._ops()

    # ----------------------------------------------------------------- lifecycle
    @property
    def address(self) -> str:
        """The address clients connect to (known once started)."""
        if self._address is None:
            raise RuntimeError("TransferQueueServer.address is known only after start()")
        return self._address

    @property
    def shm_dir(self) -> str | None:
        """The shared-memory directory same-host clients write payloads into (None: TCP only)."""
        return None if self._shm is None else self._shm.path

    def start(self, timeout: float = 10.0) -> str:
        """Bind and serve in a daemon thread; returns the address to connect to."""
        if self._thread is not None:
            return self.address
        self._thread = threading.Thread(target=self.serve_forever, name="transfer-queue", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            self.stop()
            raise RuntimeError(f"transfer queue server could not bind {self._bind!r}: {self._error}")
        return self.address

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> TransferQueueServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Run the event loop in the calling thread until :meth:`stop`."""
        ctx = zmq.Context()
        zap = ZapHandler(ctx, self._keys)  # before the bind: no connection is ever let in unasked
        sock = self._router(ctx, self._max_frame_bytes)
        set_server_keys(sock, self._keys)
        # On the data socket a sealed frame is its tag longer.
        data = self._router(ctx, self._max_frame_bytes + TAG_BYTES) if self._session_keys is not None else None
        try:
            sock.bind(self._bind.replace(":0", ":*") if self._bind.endswith(":0") else self._bind)
            self._address = _connectable(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            if data is not None:
                self._data_port = _bind_next_to(data, self._address, self._bind)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            sock.close(0)
            if data is not None:
                data.close(0)
            zap.close()
            ctx.term()
            return
        if self._want_shm:
            try:
                self._shm = self._queue_ops.shm = ShmStore(self._shm_root)
            except OSError as exc:  # no tmpfs here: every client stays on TCP
                log.warning("transfer queue: no shared-memory path (%s); clients use TCP only", exc)
            else:
                self._ipc = self._bind_same_host(sock, self._shm.ipc_address)
        self._ready.set()
        try:
            self._loop(sock, zap, data)
        finally:
            sock.close(0)
            if data is not None:
                data.close(0)
                log.info("transfer queue: %d session(s) sealed (%s) on the data socket; %d message(s) there "
                         "did not open and were dropped", self._sealed_sessions,
                         self._session_keys.mode if self._session_keys else "", self._unopened)
            zap.close()
            ctx.term()
            if self._shm is not None:
                self._shm.close()

    def _router(self, ctx: zmq.Context[Any], max_frame_bytes: int) -> zmq.Socket[Any]:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished client's reply is dropped, not an error
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(self._heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self._heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(self._heartbeat_timeout_s * 1000))
        return sock

    @staticmethod
    def _bind_same_host(sock: zmq.Socket[Any], address: str | None) -> str | None:
        """Also listen on a Unix socket in the shm directory: a same-host request then skips
        the TCP loopback (a bare pyzmq round trip: 78 us instead of 102 us on the development host)."""
        if address is None:
            return None
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            log.warning("transfer queue: same-host endpoint %s unavailable (%s); clients use TCP", address, exc)
            return None
        return address

    # ----------------------------------------------------------------- event loop
    def _loop(self, sock: zmq.Socket[Any], zap: ZapHandler, data: zmq.Socket[Any] | None) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(zap.socket, zmq.POLLIN)
        if data is not None:
            poller.register(data, zmq.POLLIN)
        plain = PlainRoute(sock)
        next_probe = time.monotonic() + self._heartbeat_s
        while not self._stop.is_set():
            wait = self._poll_interval_s
            if self._parked:
                wait = min(wait, max(0.0, min(r.deadline for r in self._parked) - time.monotonic()))
            ready = dict(poller.poll(wait * 1000))
            if zap.socket in ready:  # a connection waits for its handshake
                zap.answer_pending()
            changed = False
            if sock in ready:
                changed |= self._drain(sock, lambda frames: self._handle(plain, frames))
            if data is not None and data in ready:
                changed |= self._drain(data, lambda frames: self._handle_sealed(data, frames))
            if changed and self._parked:
                self._retry_parked()
            self._expire_parked()
            if time.monotonic() >= next_probe:
                self._drop_vanished()
                next_probe = time.monotonic() + self._heartbeat_s

    @staticmethod
    def _drain(sock: zmq.Socket[Any], handle: Any) -> bool:
        """Handle a burst of messages (then the loop looks at parked requests once)."""
        changed = False
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            changed |= handle(frames)
        return changed

    def _handle_sealed(self, data: zmq.Socket[Any], frames: list[Any]) -> bool:
        """A message on the data socket: opened with its session's key, or dropped unanswered
        (not a key this server handed out, altered, replayed): only a session's key holder may
        get an answer."""
        assert self._session_keys is not None
        try:
            sealer, session, opened = self._session_keys.open(frames[1:])
        except SealError as exc:
            self._unopened += 1
            if self._unopened == 1 or self._unopened % 1000 == 0:
                log.warning("transfer queue: dropped %d message(s) on the data socket that did not open (%s)",
                            self._unopened, exc)
            return False
        if sealer.opened == 1:
            self._sealed_sessions += 1
        return self._handle(SealedRoute(data, sealer, session), [frames[0], *opened])

    def _handle(self, route: Route, frames: list[Any]) -> bool:
        """Answer or park one message; returns whether the state may have changed."""
        identity = bytes(memoryview(frames[0]))
        req = Request(identity, {}, frames[2:], None, None, route=route)
        try:
            if len(frames) < 2:
                raise WireError("empty message: expected [header, buffers...]")
            req.header = unpack_header(frames[1], self._max_header_bytes)
            req.req_id = arg(req.header, "id", int) if "id" in req.header else None
            session = req.header.get("s")
            if isinstance(session, str) and len(session) > MAX_SESSION_LEN:
                raise WireError(f"session id of {len(session)} characters; at most {MAX_SESSION_LEN}")
            req.session = session if isinstance(session, str) and session else None
            if route.session is not None and req.session != route.session:
                raise WireError("a session's key carries only that session's requests")
            if req.header.get("v") != WIRE_VERSION:
                raise WireError(f"wire version {req.header.get('v')!r} is not {WIRE_VERSION}; upgrade the client")
            if req.session is not None:
                try:
                    self._sessions.bind(req.session, req.header)
                except ConsumerMismatchError:
                    req.session = None  # not cached as that session's reply to this request id
                    raise
            if self._is_duplicate(req):
                return False
            op = arg(req.header, "op", str)
            handler = self._handlers.get(op)
            if handler is None:
                raise WireError(f"unknown op {op!r}; known: {sorted(self._handlers)}")
            reply = handler(req)
            if reply is None:
                self._park(req)
            else:
                self._send(req, reply)
            # even a parked get may have changed state: a restarted consumer frees its rows
            return op not in ("ping", "partitions", "oldest", "may_start")
        except WireError as exc:
            self._send_error(req, "invalid", f"malformed request: {exc}")
        except (TransferQueueError, ValueError) as exc:
            self._send_error(req, "refused", str(exc))
        except Refused as exc:
            self._send_error(req, exc.kind, str(exc))
        except Exception as exc:  # never let one request take the server down
            log.exception("transfer queue: internal error on %r", req.header.get("op"))
            self._send_error(req, "internal", f"{type(exc).__name__}: {exc}")
        return True

    def _ops(self) -> dict[str, Handler]:
        return {"ping": self._ping, **self._queue_ops.handlers()}

    def _ping(self, req: Request) -> list[Any]:
        reply: dict[str, Any] = {"capacity": self._state.capacity, "ipc": self._ipc,
                                 "limits": {"frame": self._max_frame_bytes, "header": self._max_header_bytes},
                                 **(self._shm.describe() if self._shm else {})}
        # A session's key goes out only inside CURVE, to a session that names itself.
        if self._session_keys is not None and isinstance(req.route, PlainRoute) and req.session is not None:
            reply["sealed"] = {"port": self._data_port, **self._session_keys.issue(req.session)}
        return [reply]

    # ----------------------------------------------------------------- parking
    def _park(self, req: Request) -> None:
        self._parked.append(req)
        if req.session is not None and req.req_id is not None:
            self._remember(req.session, req.req_id, None)

    def _retry_parked(self) -> None:
        # Answering one parked request (a put) can unblock another (a get): loop until quiet.
        progress = True
        while progress and self._parked:
            progress = False
            for req in list(self._parked):
                assert req.attempt is not None
                try:
                    reply = req.attempt()
                except (TransferQueueError, ValueError) as exc:
                    self._parked.remove(req)
                    self._send_error(req, "refused", str(exc))
                    continue
                except Exception as exc:  # never let one request take the server down
                    log.exception("transfer queue: internal error on a parked %r", req.header.get("op"))
                    self._parked.remove(req)
                    self._send_error(req, "internal", f"{type(exc).__name__}: {exc}")
                    continue
                if reply is not None:
                    self._parked.remove(req)
                    self._send(req, reply)
                    progress = True

    def _expire_parked(self) -> None:
        now = time.monotonic()
        for req in [r for r in self._parked if r.deadline <= now]:
            self._parked.remove(req)
            assert req.timeout_message is not None
            message = req.timeout_message(now - req.started)
            self._send_error(req, "timeout", message)

    def _drop_vanished(self) -> None:
        """Drop the parked requests whose peer ROUTER no longer knows (its connection closed):
        with ROUTER_MANDATORY a send to an unknown routing id fails with EHOSTUNREACH. A live peer
        gets the probe and ignores it (unsealed on the data socket: it opens under no key); one
        whose queue is full (EAGAIN) counts as live."""
        if not self._parked:
            return
        gone: set[tuple[int, bytes]] = set()
        for sock in {r.route.sock for r in self._parked}:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            try:
                for identity in {r.identity for r in self._parked if r.route.sock is sock}:
                    try:
                        sock.send_multipart([identity, PROBE], zmq.NOBLOCK)
                    except zmq.ZMQError as exc:
                        if exc.errno == zmq.EHOSTUNREACH:
                            gone.add((id(sock), identity))
            finally:
                sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        dropped = [r for r in self._parked if (id(r.route.sock), r.identity) in gone]
        for req in dropped:
            self._parked.remove(req)
            self._discard_files(req)
            replies = self._replies.get(req.session) if req.session is not None else None
            if replies is not None and req.req_id is not None and replies.get(req.req_id, []) is None:
                del replies[req.req_id]  # forgotten: a resend of it is served as new
        if dropped:
            log.info("transfer queue: dropped %d parked request(s) of %d vanished client(s)", len(dropped), len(gone))

    # ----------------------------------------------------------------- replies
    def _is_duplicate(self, req: Request) -> bool:
        """A client retry of a request it has not had the answer to: resend it, or wait for it."""
        if req.session is None or req.req_id is None:
            return False
        replies = self._replies.get(req.session)
        if replies is None:
            return False
        oldest_unanswered = req.header.get("r")
        if isinstance(oldest_unanswered, int):  # the client has every reply before this one
            while replies and next(iter(replies)) < oldest_unanswered:
                replies.popitem(last=False)
        if req.req_id not in replies:
            return False
        payload = replies[req.req_id]
        if payload is not None:
            req.route.send(req.identity, payload)
        else:  # still parked: answer the retry's socket when it completes
            for parked in self._parked:
                if parked.session == req.session and parked.req_id == req.req_id:
                    parked.identity, parked.route = req.identity, req.route
        return True

    def _remember(self, session: str, req_id: int, payload: list[Any] | None) -> None:
        replies = self._replies.get(session)
        if replies is None:
            replies = self._replies[session] = OrderedDict()
        replies[req_id] = payload
        while len(replies) > MAX_REPLIES_PER_SESSION:
            replies.popitem(last=False)
        self._replies.move_to_end(session)
        while len(self._replies) > MAX_SESSIONS_REMEMBERED:
            self._replies.popitem(last=False)

    def _send(self, req: Request, reply: list[Any]) -> None:
        header = {"id": req.req_id, "ok": True, **reply[0]}
        payload = [pack_header(header), *reply[1:]]
        if req.session is not None and req.req_id is not None:
            self._remember(req.session, req.req_id, payload)
        req.route.send(req.identity, payload)

    def _discard_files(self, req: Request) -> None:
        """The request was not applied: the shm payloads it named go back to their producer."""
        if req.files and self._shm is not None:
            files, req.files = req.files, set()
            try:
                self._shm.discard(files)
            except OSError as exc:  # the orphan sweep removes them later
                log.warning("transfer queue: could not release shm payloads %s: %s", sorted(files), exc)

    def _send_error(self, req: Request, kind: str, message: str) -> None:
        self._discard_files(req)
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS] + " [...]"
        payload = [pack_header({"id": req.req_id, "ok": False, "kind": kind, "error": message})]
        if req.session is not None and req.req_id is not None:
            self._remember(req.session, req.req_id, payload)
        try:
            req.route.send(req.identity, payload, copy=True)
        except zmq.ZMQError:
            log.warning("transfer queue: could not send an error reply: %s", message)


def _bind_next_to(data: zmq.Socket[Any], address: str, bind: str) -> int:
    """Bind the data socket on the CURVE socket's interface, any free port; returns the port
    (a client connects to the host it reached the server by, on this port)."""
    if not address.startswith("tcp://"):
        raise zmq.ZMQError(msg=f"sealed payloads need a tcp:// address, not {bind!r}")
    data.bind(bind.rsplit(":", 1)[0] + ":*")
    return int(data.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


def _connectable(endpoint: str) -> str:
    """Replace a wildcard bind host by this machine's name so the address can be shared."""
    for wildcard in ("0.0.0.0", "*", "[::]"):
        prefix = f"tcp://{wildcard}:"
        if endpoint.startswith(prefix):
            return f"tcp://{pysocket.gethostname()}:{endpoint[len(prefix):]}"
    return endpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve a relax-hpc transfer queue.")
    parser.add_argument("--bind", default="tcp://0.0.0.0:0", help="ZMQ address; port 0 picks a free port")
    parser.add_argument("--capacity", type=int, default=None, help="row bound (default: unbounded)")
    parser.add_argument("--payload", choices=("encrypt", "authenticate", "curve"), default="curve",
                        help="how TCP clients' messages are protected ([security] payload; default: curve)")
    args = parser.parse_args(argv)
    server = TransferQueueServer(args.bind, args.capacity, secret=job_secret(), payload=args.payload)
    server.start()
    print(server.address, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
