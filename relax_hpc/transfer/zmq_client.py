"""ZMQ transfer queue client: the :class:`TransferQueue` interface over a DEALER socket.

One client is one consumer session. Calls are serialised by a lock; give each thread its own
client for parallel traffic. Each request carries an id: a retry after a lost reply is answered
from the server's reply cache, so a retried put never adds rows twice and a retried get never
loses rows (:mod:`relax_hpc.transfer.zmq_requests`).

Two calls keep requests in flight instead of waiting for each reply, because a round trip
through the server costs as much as moving a 64 KiB sample: :meth:`TransferQueueClient.put_async`
(a producer sends its next rows while the server files the last ones; at most ``MAX_IN_FLIGHT``
puts) and :meth:`TransferQueueClient.stream` (a consumer's next get is on its way while it works
on the current batch). Every other call first waits for the puts in flight, so a ``complete``
or ``clear`` never overtakes them.

Tensors are sent as memoryviews of their CPU data (no copy) and received tensors are built on
the received frames (no copy); do not mutate a tensor while a put is in progress.

On the server's host the payloads go through shared memory instead (see
:mod:`relax_hpc.transfer.shm`): a put/write writes them into one payload file and sends only
references; a get reads them into new tensors that own their memory. The client decides at
connect time: the server must advertise a shm directory, report this host's id, and the
directory must be readable and writable here; ``shm=False`` or ``RELAX_TQ_SHM=0`` keeps TCP.

Every connection is a CURVE one with the job's client keys (:mod:`relax_hpc.transfer.curve`);
a server that refuses them ends the connect with :class:`TransferAuthError` at once. A server
whose payloads are sealed (``payload = "encrypt" | "authenticate"``) hands a TCP client its
session key in the ping reply; the client then sends everything on the server's data socket,
each message sealed with that key (:mod:`relax_hpc.transfer.sealed_socket`).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from relax_hpc.auth import JobSecret
from relax_hpc.transfer.curve import (
    HandshakeWatch,
    TransferAuthError,
    queue_keys,
    refused_message,
    set_client_keys,
)
from relax_hpc.transfer.limits import HEARTBEAT_S, HEARTBEAT_TIMEOUT_S, fit_frames
from relax_hpc.transfer.seal import TO_SERVER, Sealer
from relax_hpc.transfer.sealed_socket import SealedDealer
from relax_hpc.transfer.queue import (
    Batch,
    PartitionInfo,
    Row,
    TransferQueueError,
    TransferTimeoutError,
    TransferUnreachableError,
    check_name,
)
from relax_hpc.transfer.shm import (
    SegmentPool,
    ShmMaps,
    client_can_use,
    same_host_endpoint,
    shm_enabled_by_env,
)
from relax_hpc.transfer.wire import Block, Buffer, WireError
from relax_hpc.transfer.wire_decode import materialize_blocks
from relax_hpc.transfer.wire_encode import array_buffers, blocks_to_wire, encode_blocks
from relax_hpc.transfer.zmq_requests import Reply, RequestPipe, unreachable_message


log = logging.getLogger(__name__)

# Frames below this size are copied into the message instead of sent zero-copy: pyzmq's
# zero-copy bookkeeping costs more than a memcpy of a small buffer (measured in
# benchmarks/bench_queue.py; see docs/transfer-queue.md).
ZERO_COPY_MIN_BYTES = int(os.environ.get("RELAX_TQ_ZERO_COPY_MIN", 256 * 1024))
# A put/write whose tensors hold fewer bytes than this travels over TCP even on the server's
# host: creating, renaming and later deleting a file costs more than sending a few KiB.
SHM_MIN_BYTES = int(os.environ.get("RELAX_TQ_SHM_MIN_BYTES", 16 * 1024))
# Puts a client keeps unanswered (put_async); the next one waits for the oldest reply.
MAX_IN_FLIGHT = 4


class PendingPut:
    """A put sent by :meth:`TransferQueueClient.put_async`; :meth:`result` waits for its reply."""

    def __init__(self, client: TransferQueueClient, req_id: int, partition: str, n_rows: int,
                 segment: str | None) -> None:
        self._client = client
        self.req_id = req_id
        self.partition = partition
        self.n_rows = n_rows
        self.segment = segment  # the shm payload file, given back to the pool if the put is refused
        self.done = False
        self.indices: list[int] = []
        self.error: BaseException | None = None

    def result(self) -> list[int]:
        """The row indices, as :meth:`TransferQueueClient.put` returns them; raises its error."""
        if not self.done:
            with self._client._lock:
                self._client._settle(self)
        if self.error is not None:
            raise self.error
        return self.indices


def _stream_key(partition: str, task: str, fields: Sequence[str], batch_size: int) -> tuple[Any, ...]:
    return (partition, task, tuple(fields), batch_size)


class TransferQueueClient:
    """Connect to a :class:`~relax_hpc.transfer.zmq_server.TransferQueueServer`.

    ``secret``: the job secret the server was started with (``job_secret()`` in a role); with
    another one the connect raises :class:`TransferAuthError`.
    ``connect_timeout``: how long the handshake, and then the first ping, may take. ``request_timeout``: how long a
    reply may take beyond the call's own blocking timeout; a request is sent ``1 + retries``
    times before :class:`TransferUnreachableError`. ``shm``: use the same-host shared-memory
    path when the server offers it and this process can see it (None: unless ``RELAX_TQ_SHM=0``;
    False: always TCP). ``shm_min_bytes``: smallest put/write payload that goes through shm.
    """

    def __init__(
        self,
        address: str,
        *,
        secret: JobSecret,
        consumer_id: str = "",
        connect_timeout: float = 10.0,
        request_timeout: float = 30.0,
        retries: int = 2,
        context: zmq.Context[Any] | None = None,
        shm: bool | None = None,
        shm_min_bytes: int | None = None,
    ) -> None:
        if retries < 0 or request_timeout <= 0 or connect_timeout <= 0:
            raise ValueError(
                f"need retries >= 0, request_timeout > 0, connect_timeout > 0; got {retries}, "
                f"{request_timeout}, {connect_timeout}"
            )
        self.address = address
        self.consumer_id = consumer_id
        self.session = uuid.uuid4().hex
        self._request_timeout = request_timeout
        self._retries = retries
        self._lock = threading.Lock()
        self._ctx = context or zmq.Context.instance()
        curve = self._dealer()
        set_client_keys(curve, queue_keys(secret))
        handshakes = HandshakeWatch(curve)
        curve.connect(address)
        self._sock: zmq.Socket[Any] | SealedDealer = curve
        self.endpoint = address  # where requests go: a same-host client moves to ipc:// after the ping
        self._pipe = RequestPipe(self._sock, address, self.session, consumer_id)
        self._puts: deque[PendingPut] = deque()  # put_async calls not answered yet, oldest first
        self._prefetched: dict[tuple[Any, ...], int] = {}  # stream arguments -> get request in flight
        self._closed = False
        self._pool: SegmentPool | None = None
        self._maps: ShmMaps | None = None
        self._retired: zmq.Socket[Any] | SealedDealer | None = None
        try:
            self._await_handshake(handshakes, address, connect_timeout)
            reply, _ = self._request({"op": "ping"}, (), wait=0.0, timeout=connect_timeout, retries=0)
            self._apply_ping(reply, shm, shm_min_bytes, handshakes, connect_timeout)
        except BaseException:
            handshakes.close()  # before the socket it watches
            self.close()
            raise
        handshakes.close()
        self._close_retired()

    def _apply_ping(self, reply: dict[str, Any], shm: bool | None, shm_min_bytes: int | None,
                    handshakes: HandshakeWatch, connect_timeout: float) -> None:
        """Take what the ping reply says; on the server's host, move to shm and ipc://."""
        self.capacity: int | None = reply.get("capacity")
        limits = reply.get("limits") or {}  # the server drops a larger frame, refuses a larger header
        self._max_frame: int | None = limits.get("frame")
        self._pipe.max_header = limits.get("header")
        want_shm = shm_enabled_by_env() if shm is None else shm
        use_shm = want_shm and client_can_use(reply.get("host"), reply.get("shm"))
        self.shm_dir: str | None = str(reply["shm"]) if use_shm else None
        self.payload = "curve"  # how this session's messages are protected
        if not use_shm and isinstance(reply.get("sealed"), dict):
            self._move_to_sealed(reply["sealed"])
        self._shm_min_bytes = SHM_MIN_BYTES if shm_min_bytes is None else shm_min_bytes
        self._payloads = itertools.count()
        if self.shm_dir is not None:
            self._pool = SegmentPool(self.shm_dir)
            self._maps = ShmMaps(self.shm_dir)
            endpoint = same_host_endpoint(self.shm_dir, reply.get("ipc"))
            if endpoint is not None:
                self._move_to_same_host_endpoint(endpoint)
                self._await_handshake(handshakes, endpoint, connect_timeout)

    # ----------------------------------------------------------------- the interface
    def put(self, partition: str, rows: Sequence[Row], timeout: float = 60.0) -> list[int]:
        return self.put_async(partition, rows, timeout).result()

    def put_async(self, partition: str, rows: Sequence[Row], timeout: float = 60.0) -> PendingPut:
        """Send a put without waiting for its reply; ``.result()`` gives the row indices.

        At most ``MAX_IN_FLIGHT`` puts are unanswered: a further one first waits for the oldest
        and raises its error, if any. Any other call of this client waits for all of them first
        and raises the first error nobody has seen through ``.result()``. Do not change the
        tensors until the put is answered.
        """
        check_name("partition", partition)
        with self._lock:
            self._check_open()
            while len(self._puts) >= MAX_IN_FLIGHT:
                self._settle(self._puts[0], raise_error=True)
            header = {"op": "put", "p": partition, "timeout": timeout}
            req_id, segment = self._send_rows(header, rows, timeout)
            pending = PendingPut(self, req_id, partition, len(rows), segment)
            self._puts.append(pending)
            return pending

    def write(self, partition: str, indices: Sequence[int], rows: Sequence[Row]) -> None:
        check_name("partition", partition)
        with self._lock:
            self._check_open()
            self._settle_puts()
            req_id, segment = self._send_rows({"op": "write", "p": partition, "idx": list(indices)}, rows, 0.0)
            self._collect_rows(req_id, segment)

    def get(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        timeout: float = 60.0,
        ack: Sequence[int] = (),
    ) -> Batch:
        header = self._get_header(partition, task, fields, batch_size, timeout, ack)
        reply, frames = self._call(header, (), timeout)
        return self._batch(partition, reply, frames)

    def stream(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        timeout: float = 60.0,
        ack: bool = True,
    ) -> Iterator[Batch]:
        """Every batch of ``partition`` for ``task``, the next get already on its way while the
        caller works on the current batch (see :meth:`TransferQueue.stream`).

        With ``ack``, a batch is acked by a later get once the caller has asked for the batch
        after it, and the rest when the stream ends or a get fails. A stream left early leaves the
        current batch and the one fetched ahead unacked: they go to the next session of this
        consumer id, as after a crash.
        """
        finished: list[int] = []  # asked past, not acked yet
        with self._lock:
            prefetched = self._prefetched.pop(_stream_key(partition, task, fields, batch_size), None)
        in_flight: int | None = prefetched
        if in_flight is None:
            in_flight = self._send_get(partition, task, fields, batch_size, timeout, ())
        try:
            while in_flight is not None:
                asked, in_flight = in_flight, None  # on failure what was asked past is acked below
                try:
                    with self._lock:
                        reply, frames = self._pipe.collect(asked)
                except TransferTimeoutError:
                    if asked != prefetched:
                        raise
                    # Asked for long before this stream began: ask again with the full timeout.
                    prefetched = None
                    in_flight = self._send_get(partition, task, fields, batch_size, timeout, ())
                    continue
                if not reply.get("end"):  # ask for the next batch before reading this one's bytes
                    in_flight = self._send_get(partition, task, fields, batch_size, timeout, finished)
                    finished = []
                batch = self._batch(partition, reply, frames)
                yield batch
                if ack:
                    finished = [*finished, *batch.indices]
            if finished:
                self.ack(partition, task, finished)
                finished = []
        finally:
            if in_flight is not None:
                with self._lock:
                    self._pipe.abandon(in_flight)
            if finished:  # left early: what the caller asked past is done
                self._ack_quietly(partition, task, finished)

    def prefetch(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                 timeout: float = 60.0) -> None:
        """Send the first get of a later :meth:`stream` with these arguments now (see
        :meth:`TransferQueue.prefetch`); asking twice for the same stream sends one request."""
        key = _stream_key(partition, task, fields, batch_size)
        with self._lock:
            if key in self._prefetched:
                return
        req_id = self._send_get(partition, task, fields, batch_size, timeout, ())
        with self._lock:
            self._prefetched[key] = req_id

    def _ack_quietly(self, partition: str, task: str, indices: list[int]) -> None:
        try:
            self.ack(partition, task, indices)
        except TransferQueueError as exc:  # unacked rows go to the next session: nothing is lost
            log.warning("transfer queue: could not ack %d rows of %r for %r: %s", len(indices), partition, task, exc)

    def ack(self, partition: str, task: str, indices: Sequence[int]) -> int:
        reply, _ = self._call({"op": "ack", "p": partition, "task": task, "idx": list(indices)})
        return int(reply["n"])

    def complete(self, partition: str, total_rows: int) -> None:
        self._call({"op": "complete", "p": partition, "total": total_rows})

    def clear(self, partition: str) -> int:
        reply, _ = self._call({"op": "clear", "p": partition})
        return int(reply["n"])

    def partitions(self) -> list[PartitionInfo]:
        reply, _ = self._call({"op": "partitions"})
        return [PartitionInfo(n, r, e, c, list(f)) for n, r, e, c, f in reply["parts"]]

    def oldest_uncleared(self) -> int | None:
        reply, _ = self._call({"op": "oldest"})
        step = reply["step"]
        return None if step is None else int(step)

    def may_start(self, step: int, max_staleness: int) -> bool:
        reply, _ = self._call({"op": "may_start", "step": step, "max_staleness": max_staleness})
        return bool(reply["allowed"])

    def wait_until_may_start(self, step: int, max_staleness: int, timeout: float = 600.0) -> None:
        self._call({"op": "wait_start", "step": step, "max_staleness": max_staleness, "timeout": timeout}, (), timeout)

    def close(self) -> None:
        """Wait for the puts in flight (a failed one is logged), then close the socket. Rows
        received but not acked are handed out again to the next session of this consumer id
        (that is the restart path)."""
        with self._lock:
            if not self._closed:
                for pending in list(self._puts):  # unsent messages die with the socket
                    self._settle(pending)
                    if pending.error is not None:
                        log.warning("transfer queue: put_async of %d rows to %r failed before close: %s",
                                    pending.n_rows, pending.partition, pending.error)
                self._closed = True
                self._sock.close(0)
                self._close_retired()
                if self._pool is not None:
                    self._pool.close()
                if self._maps is not None:
                    self._maps.close()

    def __enter__(self) -> TransferQueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- transport
    def _await_handshake(self, handshakes: HandshakeWatch, endpoint: str, timeout: float) -> None:
        """Return once the server accepted this client's keys on ``endpoint``; raise at once
        when it refuses them, or after ``timeout`` when nobody answers."""
        verdict = handshakes.wait(endpoint, timeout)
        if verdict is None:
            raise TransferUnreachableError(unreachable_message(self.address, timeout, 1, "ping"))
        if verdict != "ok":
            raise TransferAuthError(refused_message(self.address, verdict))

    def _close_retired(self) -> None:
        if self._retired is not None:
            self._retired.close(0)
            self._retired = None

    def _dealer(self) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.copy_threshold = ZERO_COPY_MIN_BYTES
        # a server that stopped answering, even heartbeats, is disconnected (then reconnected)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(HEARTBEAT_TIMEOUT_S * 1000))
        return sock

    def _move_to_sealed(self, sealed: dict[str, Any]) -> None:
        """Send every later request on the server's data socket, sealed with the session key
        the (CURVE-encrypted) ping reply carried; nothing is in flight yet."""
        try:
            sealer = Sealer(bytes.fromhex(sealed["kid"]), bytes.fromhex(sealed["key"]), sealed["mode"], TO_SERVER)
            endpoint = f"{self.address.rsplit(':', 1)[0]}:{int(sealed['port'])}"
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferQueueError(
                f"transfer queue at {self.address} offered a sealed session this client cannot use ({exc}); "
                "are the driver and this role the same relax-hpc version?") from None
        sock = self._dealer()
        sock.connect(endpoint)
        self._retired = self._sock  # the CURVE socket, closed once its handshake watch is
        self._sock = SealedDealer(sock, sealer)
        self._pipe.use(self._sock)
        self.endpoint = endpoint
        self.payload = sealer.mode

    def _move_to_same_host_endpoint(self, endpoint: str) -> None:
        """Send requests over the server's Unix socket instead of TCP (same host, nothing in
        flight yet); ``address`` stays the TCP one that error messages name."""
        assert not isinstance(self._sock, SealedDealer)
        self._sock.disconnect(self.address)
        self._sock.connect(endpoint)
        self.endpoint = endpoint

    def _check_open(self) -> None:
        if self._closed:
            raise TransferQueueError(f"client for {self.address} is closed")

    def _get_header(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                    timeout: float, ack: Sequence[int]) -> dict[str, Any]:
        check_name("partition", partition)
        check_name("task", task)
        names = [check_name("field", f) for f in fields]
        header = {"op": "get", "p": partition, "task": task, "fields": names, "n": batch_size, "timeout": timeout}
        if ack:
            header["ack"] = list(ack)
        if self.shm_dir is not None:
            header["m"] = True  # answer with shm references: this client reads them itself
        return header

    def _send_get(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                  timeout: float, ack: Sequence[int]) -> int:
        header = self._get_header(partition, task, fields, batch_size, timeout, ack)
        with self._lock:
            self._check_open()
            self._settle_puts()
            return self._pipe.send(header, (), timeout, self._request_timeout, self._retries)

    def _batch(self, partition: str, reply: dict[str, Any], frames: list[Any]) -> Batch:
        try:
            blocks = reply.get("blocks")
            rows = materialize_blocks(blocks, frames) if self._maps is None else self._maps.read_blocks(blocks, frames)
        except WireError as exc:
            raise TransferQueueError(f"transfer queue at {self.address} sent a malformed batch: {exc}") from None
        return Batch(partition, list(reply["idx"]), rows, bool(reply["end"]))

    def _send_rows(self, header: dict[str, Any], rows: Sequence[Row], wait: float) -> tuple[int, str | None]:
        """Send a put/write: payloads as frames, or in one shm payload file with references.
        Returns the request id and the shm file (None: frames)."""
        blocks = encode_blocks(rows)
        frames: list[Buffer] = []
        name = self._to_shm(blocks) if self.shm_dir is not None else None
        if name is None and self._max_frame is not None:
            fit_frames(blocks, self._max_frame)
        header["blocks"] = blocks_to_wire(blocks, frames, name)
        req_id = self._pipe.send(header, frames, wait, self._request_timeout, self._retries)
        return req_id, None if name is None else name[0]

    def _collect_rows(self, req_id: int, segment: str | None) -> Reply:
        try:
            return self._pipe.collect(req_id)
        except TransferUnreachableError:
            raise  # the server may still apply it: the file stays, an orphan sweep removes it if not
        except TransferQueueError:
            if segment is not None and self._pool is not None:  # refused: the segment is ours again
                self._pool.release(segment)
            raise

    def _settle(self, pending: PendingPut, raise_error: bool = False) -> None:
        """Collect the reply of ``pending`` (lock held); with ``raise_error`` raise its error."""
        if not pending.done:
            self._puts.remove(pending)
            try:
                reply, _ = self._collect_rows(pending.req_id, pending.segment)
                pending.indices = list(reply["idx"])
            except TransferQueueError as exc:
                pending.error = exc
            except BaseException as exc:  # interrupted: the put's fate is unknown, and says so
                pending.error = exc
                raise
            finally:
                pending.done = True
        if raise_error and pending.error is not None:
            raise pending.error

    def _settle_puts(self) -> None:
        """Wait for every put in flight (lock held); raise the first error among them."""
        settled = list(self._puts)
        for pending in settled:
            self._settle(pending)
        for pending in settled:
            if pending.error is not None:
                raise pending.error

    def _to_shm(self, blocks: list[Block]) -> tuple[str, list[int]] | None:
        """Write the array bytes into one shm file: (file, offsets); None when too small to bother."""
        buffers = array_buffers(blocks)
        if not buffers or sum(memoryview(b).nbytes for b in buffers) < self._shm_min_bytes:
            return None
        assert self._pool is not None
        name = f"{self.session}-{next(self._payloads)}"
        try:
            return name, self._pool.write(name, buffers)
        except OSError as exc:  # shm full or gone: this call travels over TCP instead
            log.warning("transfer queue: shm write to %s failed (%s); sending over TCP", self.shm_dir, exc)
            return None

    def _call(self, header: dict[str, Any], frames: Sequence[Buffer] = (), wait: float = 0.0) -> Reply:
        return self._request(header, frames, wait, self._request_timeout, self._retries)

    def _request(self, header: dict[str, Any], frames: Sequence[Buffer], wait: float, timeout: float,
                 retries: int) -> Reply:
        """Send, after the puts in flight are answered, and wait ``wait + timeout`` seconds per
        attempt; raise on an error reply."""
        with self._lock:
            self._check_open()
            self._settle_puts()
            return self._pipe.collect(self._pipe.send(header, frames, wait, timeout, retries))
