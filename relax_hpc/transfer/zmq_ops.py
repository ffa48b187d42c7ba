"""What each request of the ZMQ transfer queue does to the queue: one handler per op.

A handler reads its header fields (typed: :mod:`relax_hpc.transfer.wire`), applies the request
to the :class:`~relax_hpc.transfer.state.QueueState` and returns the reply as
``[header-dict, *frames]``; one that cannot be answered yet (a get waiting for rows, a put
against a full queue, a staleness wait) sets the request's ``attempt`` and returns None, and
the server parks it. The socket, the event loop, the parked requests' retries and deadlines
and the reply cache for retried requests are :mod:`relax_hpc.transfer.zmq_server`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relax_hpc.transfer.limits import MAX_REQUEST_ROWS, request_rows
from relax_hpc.transfer.queue import TransferQueueError, check_name
from relax_hpc.transfer.shm import ShmStore
from relax_hpc.transfer.state import Owner, QueueState
from relax_hpc.transfer.wire import Buffer, Encoded, WireError, arg, int_list_arg, name_arg, name_list_arg, shm_files
from relax_hpc.transfer.wire_decode import decode_blocks
from relax_hpc.transfer.wire_encode import stored_to_wire

MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass
class Request:
    """One request as the server holds it: its sender, header and buffers; parked, how to answer it."""

    identity: bytes
    header: dict[str, Any]
    frames: list[Buffer]
    session: str | None
    req_id: int | None
    deadline: float = 0.0
    started: float = field(default_factory=time.monotonic)
    attempt: Callable[[], list[Any] | None] | None = None  # parked: returns a reply or None
    timeout_message: Callable[[float], str] | None = None
    files: set[str] = field(default_factory=set)  # shm payloads named by a put/write not yet applied
    route: Any = None  # how its reply goes out (relax_hpc/transfer/sealed_socket.py: Route)


class Refused(Exception):
    """Reply with an error of the given kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


Handler = Callable[[Request], list[Any] | None]


class QueueOps:
    """The handlers of every op but ``ping`` (the server answers that one from its sockets).

    ``parked`` is the server's list of parked requests (a clear keeps the shm payloads they
    name); ``shm`` is set by the server once its shared-memory directory exists.
    """

    def __init__(self, state: QueueState[Encoded], parked: list[Request]) -> None:
        self.state = state
        self.shm: ShmStore | None = None
        self._parked = parked

    def handlers(self) -> dict[str, Handler]:
        return {
            "put": self._op_put,
            "write": self._op_write,
            "get": self._op_get,
            "ack": self._op_ack,
            "complete": self._op_complete,
            "clear": self._op_clear,
            "partitions": self._op_partitions,
            "oldest": lambda r: [{"step": self.state.oldest_uncleared()}],
            "may_start": self._op_may_start,
            "wait_start": self._op_wait_start,
        }

    # Each returns the reply as [header-dict, *frames], or None after setting req.attempt to
    # park the request until it can be answered.
    def _op_put(self, req: Request) -> list[Any] | None:
        partition = check_name("partition", name_arg(req.header, "p"))
        blocks = arg(req.header, "blocks", list)
        # Counted from the header, no row built yet; check_put refuses more than the capacity.
        n_rows = request_rows(blocks, MAX_REQUEST_ROWS if self.state.capacity is None else None)
        self.state.check_put(partition, n_rows)
        rows = self._decode_rows(req, partition, blocks)

        def attempt() -> list[Any] | None:
            self.state.check_put(partition, n_rows)
            if not self.state.has_room(n_rows):
                return None
            indices = self.state.put(partition, rows)
            self._adopt(req, partition)
            return [{"idx": indices}]

        return _now_or_park(req, attempt, lambda waited: self.state.capacity_message(partition, n_rows, waited))

    def _op_write(self, req: Request) -> list[Any]:
        partition = name_arg(req.header, "p")
        blocks = arg(req.header, "blocks", list)
        indices = int_list_arg(req.header, "idx")
        n_rows = request_rows(blocks, self.state.capacity or MAX_REQUEST_ROWS)
        if n_rows != len(indices):
            raise TransferQueueError(
                f"write to {partition!r}: {len(indices)} indices but {n_rows} rows; pass one row dict per index"
            )
        self.state.write(partition, indices, self._decode_rows(req, partition, blocks))
        self._adopt(req, partition)
        return [{}]

    def _decode_rows(self, req: Request, partition: str, blocks: list[Any]) -> list[Any]:
        """Rows of a put/write; shm references are checked against the directory."""
        rows = decode_blocks(blocks, req.frames)
        if shm_files(rows):
            if self.shm is None:
                raise WireError("shm references sent to a server without a shared-memory directory")
            req.files = self.shm.check(rows, partition)
        return rows

    def _adopt(self, req: Request, partition: str) -> None:
        if req.files and self.shm is not None:
            self.shm.adopt(partition, req.files)
            req.files = set()

    def _op_clear(self, req: Request) -> list[Any]:
        partition = name_arg(req.header, "p")
        freed = self.state.clear(partition)
        if self.shm is not None:
            self.shm.release(partition, {f for r in self._parked for f in r.files})
        return [{"n": freed}]

    def _op_get(self, req: Request) -> list[Any] | None:
        partition = name_arg(req.header, "p")
        task = name_arg(req.header, "task")
        fields = name_list_arg(req.header, "fields")
        batch_size = arg(req.header, "n", int)
        owner = self._owner(req)
        reads_shm = req.header.get("m") is True
        if "ack" in req.header:  # applied once: a retry of this request is answered from the reply cache
            self.state.ack(partition, task, int_list_arg(req.header, "ack"), owner)

        def attempt() -> list[Any] | None:
            taken = self.state.try_get(partition, task, fields, batch_size, owner)
            if taken is None:
                return None
            rows = taken.rows
            if self.shm is not None and not reads_shm:
                rows = self.shm.inline(rows)  # another host: the bytes must travel over TCP
            frames: list[Buffer] = []
            descs = stored_to_wire(rows, frames)
            return [{"idx": taken.indices, "blocks": descs, "end": taken.end}, *frames]

        return _now_or_park(
            req,
            attempt,
            lambda waited: (
                f"get of {batch_size} rows with fields {fields} from {partition!r} for task "
                f"{task!r} timed out after {waited:.1f}s; is the producer of those fields running?"
            ),
        )

    def _op_ack(self, req: Request) -> list[Any]:
        partition = name_arg(req.header, "p")
        task = name_arg(req.header, "task")
        n = self.state.ack(partition, task, int_list_arg(req.header, "idx"), self._owner(req))
        return [{"n": n}]

    def _op_complete(self, req: Request) -> list[Any]:
        self.state.complete(name_arg(req.header, "p"), arg(req.header, "total", int))
        return [{}]

    def _op_partitions(self, req: Request) -> list[Any]:
        parts = [[p.name, p.rows, p.expected_rows, p.complete, p.fields] for p in self.state.partitions()]
        return [{"parts": parts}]

    def _op_may_start(self, req: Request) -> list[Any]:
        allowed = self.state.may_start(arg(req.header, "step", int), arg(req.header, "max_staleness", int))
        return [{"allowed": allowed}]

    def _op_wait_start(self, req: Request) -> list[Any] | None:
        step = arg(req.header, "step", int)
        max_staleness = arg(req.header, "max_staleness", int)

        def attempt() -> list[Any] | None:
            return [{}] if self.state.may_start(step, max_staleness) else None

        return _now_or_park(
            req,
            attempt,
            lambda waited: (
                f"rollout step {step} waited {waited:.1f}s for the staleness bound "
                f"(max_staleness={max_staleness}, oldest uncleared partition "
                f"{self.state.oldest_uncleared()}); the actor has not cleared it"
            ),
        )

    def _owner(self, req: Request) -> Owner:
        if req.session is None:
            raise WireError("header field 's' (session id) is required for get and ack")
        return (req.header.get("c", ""), req.session)  # checked and bound in TransferQueueServer._handle


def _now_or_park(
    req: Request,
    attempt: Callable[[], list[Any] | None],
    timeout_message: Callable[[float], str],
) -> list[Any] | None:
    """The reply now, or None with ``req`` set up to be parked until ``attempt`` answers or its
    header's ``timeout`` passes (0: refused at once with ``timeout_message``)."""
    reply = attempt()
    if reply is not None:
        return reply
    timeout = arg(req.header, "timeout", float)
    if not 0 <= timeout <= MAX_TIMEOUT_S:
        raise WireError(f"timeout {timeout} must be within 0..{MAX_TIMEOUT_S} s")
    if timeout == 0:
        raise Refused("timeout", timeout_message(0.0))
    req.deadline = req.started + timeout
    req.attempt = attempt
    req.timeout_message = timeout_message
    return None
