"""Requests from one client to the queue server, several of them in flight at once.

Every request carries its id and ``r``, the oldest id of this client still unanswered. The
server keeps its replies to this session from ``r`` on, so a request sent again after a lost
reply is answered from that cache: a put is applied once, a get loses no rows. Replies may
arrive in another order than their requests (a parked get answers late); a reply to another
request in flight is kept until that request is collected, and one to a request nobody waits
for any more (abandoned, or answered already) is dropped, as is the server's probe of whether
a client with a parked request is still connected (id nil).

Not thread-safe: the client serialises calls with its lock.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from relax_hpc.transfer.queue import TransferQueueError, TransferTimeoutError, TransferUnreachableError
from relax_hpc.transfer.seal import SealError
from relax_hpc.transfer.wire import WIRE_VERSION, Buffer, WireError, pack_header, unpack_header

Reply = tuple[dict[str, Any], list[Any]]


@dataclass
class _Flight:
    head: bytes
    frames: Sequence[Buffer]
    op: str
    per_attempt_s: float  # the call's own blocking time plus the request timeout
    timeout_s: float  # the request timeout alone, for the message
    attempts: int
    attempts_left: int
    deadline: float


class RequestPipe:
    """Send requests on ``sock`` and collect their replies by id."""

    def __init__(self, sock: Any, address: str, session: str, consumer_id: str) -> None:
        self._sock = sock
        self._address = address
        self._session = session
        self._consumer_id = consumer_id
        self._ids = itertools.count(1)
        self._flights: dict[int, _Flight] = {}
        self._early: dict[int, Reply] = {}
        self.max_header: int | None = None  # the server's limit, once its ping reply said it

    def use(self, sock: Any) -> None:
        """Send and receive on ``sock`` from now on (a zmq socket, or a sealed one); nothing
        may be in flight."""
        assert not self._flights, "moved to another socket with requests in flight"
        self._sock = sock

    def send(self, header: dict[str, Any], frames: Sequence[Buffer], wait: float, timeout: float,
             retries: int) -> int:
        """Send one request; returns its id for :meth:`collect`. It is sent ``1 + retries``
        times at most, each time waiting ``wait + timeout`` seconds for the reply."""
        req_id = next(self._ids)
        oldest = min(self._flights, default=req_id)
        head = pack_header({"v": WIRE_VERSION, "id": req_id, "r": oldest, "s": self._session,
                            "c": self._consumer_id, **header})
        if self.max_header is not None and len(head) > self.max_header:
            raise TransferQueueError(
                f"{header['op']!r} request header of {len(head)} bytes exceeds the limit of {self.max_header} "
                f"of the transfer queue at {self._address}; put/write fewer rows per call, or send long "
                "strings as uint8 tensors"
            )
        self._sock.send_multipart([head, *frames], copy=False)
        self._flights[req_id] = _Flight(head, frames, str(header["op"]), wait + timeout, timeout,
                                        1 + retries, retries, time.monotonic() + wait + timeout)
        return req_id

    def collect(self, req_id: int) -> Reply:
        """Wait for the reply to ``req_id``; raises on an error reply or when none comes."""
        flight = self._flights[req_id]
        try:
            answer = self._await(req_id, flight)
        finally:
            del self._flights[req_id]
        return check_reply(answer, flight.op, self._address)

    def abandon(self, req_id: int) -> None:
        """Stop waiting for ``req_id``: its reply, when it comes, is dropped."""
        self._flights.pop(req_id, None)
        self._early.pop(req_id, None)

    def _await(self, req_id: int, flight: _Flight) -> Reply:
        while True:
            early = self._early.pop(req_id, None)
            if early is not None:
                return early
            left = flight.deadline - time.monotonic()
            # Past the deadline, still look once: a request collected late (a stream's prefetched
            # get, while the caller worked) may have its reply waiting.
            if self._sock.poll(max(left, 0.0) * 1000, zmq.POLLIN):
                got, answer = self._receive()
                if got == req_id and answer is not None:
                    return answer
                if got is not None and answer is not None and got in self._flights:
                    self._early[got] = answer
                continue
            if left <= 0:
                if flight.attempts_left <= 0:
                    raise TransferUnreachableError(
                        unreachable_message(self._address, flight.timeout_s, flight.attempts, flight.op)
                    )
                flight.attempts_left -= 1
                self._sock.send_multipart([flight.head, *flight.frames], copy=False)
                flight.deadline = time.monotonic() + flight.per_attempt_s

    def _receive(self) -> tuple[int | None, Reply | None]:
        """One message from the socket: (request id, reply); (None, None) when unreadable."""
        try:
            frames = self._sock.recv_multipart(copy=False)
            reply = unpack_header(frames[0])
        except (WireError, SealError):
            return None, None
        got = reply.get("id")
        return (got if isinstance(got, int) else None), (reply, frames[1:])


def unreachable_message(address: str, timeout_s: float, attempts: int, op: str) -> str:
    return (
        f"transfer queue at {address} did not answer within {timeout_s:g}s ({attempts} attempt(s)) to "
        f"{op!r}; is the driver running? Check the driver's log, and that this address (from the job's "
        "cluster.json) is reachable from this node"
    )


def check_reply(answer: Reply, op: str, address: str) -> Reply:
    """The reply of a successful request; raises the error a failed one carries."""
    reply, frames = answer
    if reply.get("ok") is True:
        return reply, frames
    kind = reply.get("kind")
    message = str(reply.get("error", "no message"))
    if kind == "timeout":
        raise TransferTimeoutError(message)
    if kind == "invalid":
        raise TransferQueueError(f"transfer queue at {address} rejected {op!r} as malformed: {message}")
    if kind == "internal":
        raise TransferQueueError(f"transfer queue at {address} failed on {op!r}: {message} (see the driver log)")
    raise TransferQueueError(message)
