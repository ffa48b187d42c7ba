"""ZMQ transfer queue client: the :class:`TransferQueue` interface over a DEALER socket.

One client is one consumer session. Calls are serialised by a lock (one request in flight per
client); give each thread its own client for parallel traffic. Each request carries an id: a
retry after a lost reply is answered from the server's reply cache, so a retried put never
adds rows twice and a retried get never loses rows.

Tensors are sent as memoryviews of their CPU data (no copy) and received tensors are built on
the received frames (no copy); do not mutate a tensor while a put is in progress.

On the server's host the payloads go through shared memory instead (see
:mod:`relax_hpc.transfer.shm`): a put/write writes them into one payload file and sends only
references; a get reads them into new tensors that own their memory. The client decides at
connect time: the server must advertise a shm directory, report this host's id, and the
directory must be readable and writable here; ``shm=False`` or ``RELAX_TQ_SHM=0`` keeps TCP.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import zmq

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
    client_can_use,
    read_blocks,
    same_host_endpoint,
    shm_enabled_by_env,
)
from relax_hpc.transfer.wire import (
    WIRE_VERSION,
    Block,
    Buffer,
    WireError,
    array_buffers,
    blocks_to_wire,
    encode_blocks,
    materialize_blocks,
    pack_header,
    unpack_header,
)


log = logging.getLogger(__name__)

# Frames below this size are copied into the message instead of sent zero-copy: pyzmq's
# zero-copy bookkeeping costs more than a memcpy of a small buffer (measured in
# benchmarks/bench_queue.py; see docs/transfer-queue.md).
ZERO_COPY_MIN_BYTES = int(os.environ.get("RELAX_TQ_ZERO_COPY_MIN", 256 * 1024))
# A put/write whose tensors hold fewer bytes than this travels over TCP even on the server's
# host: creating, renaming and later deleting a file costs more than sending a few KiB.
SHM_MIN_BYTES = int(os.environ.get("RELAX_TQ_SHM_MIN_BYTES", 16 * 1024))


class TransferQueueClient:
    """Connect to a :class:`~relax_hpc.transfer.zmq_server.TransferQueueServer`.

    ``connect_timeout``: how long the first ping may take. ``request_timeout``: how long a
    reply may take beyond the call's own blocking timeout; a request is sent ``1 + retries``
    times before :class:`TransferUnreachableError`. ``shm``: use the same-host shared-memory
    path when the server offers it and this process can see it (None: unless ``RELAX_TQ_SHM=0``;
    False: always TCP). ``shm_min_bytes``: smallest put/write payload that goes through shm.
    """

    def __init__(
        self,
        address: str,
        *,
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
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.copy_threshold = ZERO_COPY_MIN_BYTES
        self._sock.connect(address)
        self.endpoint = address  # where requests go: a same-host client moves to ipc:// after the ping
        self._closed = False
        self._pool: SegmentPool | None = None
        try:
            reply, _ = self._request({"op": "ping"}, (), wait=0.0, timeout=connect_timeout, retries=0)
        except BaseException:
            self.close()
            raise
        self.capacity: int | None = reply.get("capacity")
        want_shm = shm_enabled_by_env() if shm is None else shm
        use_shm = want_shm and client_can_use(reply.get("host"), reply.get("shm"))
        self.shm_dir: str | None = str(reply["shm"]) if use_shm else None
        self._shm_min_bytes = SHM_MIN_BYTES if shm_min_bytes is None else shm_min_bytes
        self._payloads = itertools.count()
        if self.shm_dir is not None:
            self._pool = SegmentPool(self.shm_dir)
            self._move_to_same_host_endpoint(same_host_endpoint(self.shm_dir, reply.get("ipc")))

    # ----------------------------------------------------------------- the interface
    def put(self, partition: str, rows: Sequence[Row], timeout: float = 60.0) -> list[int]:
        check_name("partition", partition)
        reply, _ = self._send_rows({"op": "put", "p": partition, "timeout": timeout}, rows, timeout)
        return list(reply["idx"])

    def write(self, partition: str, indices: Sequence[int], rows: Sequence[Row]) -> None:
        check_name("partition", partition)
        self._send_rows({"op": "write", "p": partition, "idx": list(indices)}, rows, 0.0)

    def get(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        timeout: float = 60.0,
        ack: Sequence[int] = (),
    ) -> Batch:
        check_name("partition", partition)
        check_name("task", task)
        names = [check_name("field", f) for f in fields]
        header = {"op": "get", "p": partition, "task": task, "fields": names, "n": batch_size, "timeout": timeout}
        if ack:
            header["ack"] = list(ack)
        if self.shm_dir is not None:
            header["m"] = True  # answer with shm references: this client reads them itself
        reply, frames = self._call(header, (), timeout)
        try:
            blocks = reply.get("blocks")
            rows = materialize_blocks(blocks, frames) if self.shm_dir is None else read_blocks(self.shm_dir, blocks, frames)
        except WireError as exc:
            raise TransferQueueError(f"transfer queue at {self.address} sent a malformed batch: {exc}") from None
        return Batch(partition, list(reply["idx"]), rows, bool(reply["end"]))

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
        """Close the socket. Rows received but not acked are handed out again to the next
        session of this consumer id (that is the restart path)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._sock.close(0)
                if self._pool is not None:
                    self._pool.close()

    def __enter__(self) -> TransferQueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- transport
    def _move_to_same_host_endpoint(self, endpoint: str | None) -> None:
        """Send requests over the server's Unix socket instead of TCP (same host, nothing in
        flight yet); ``address`` stays the TCP one that error messages name."""
        if endpoint is None:
            return
        self._sock.disconnect(self.address)
        self._sock.connect(endpoint)
        self.endpoint = endpoint

    def _send_rows(self, header: dict[str, Any], rows: Sequence[Row], wait: float) -> tuple[dict[str, Any], list[Any]]:
        """A put/write: payloads as frames, or in one shm payload file with references."""
        blocks = encode_blocks(rows)
        frames: list[Buffer] = []
        name = self._to_shm(blocks) if self.shm_dir is not None else None
        header["blocks"] = blocks_to_wire(blocks, frames, name)
        try:
            return self._call(header, frames, wait)
        except TransferUnreachableError:
            raise  # the server may still apply it: the file stays, an orphan sweep removes it if not
        except TransferQueueError:
            if name is not None and self._pool is not None:  # refused: the segment is ours again
                self._pool.release(name[0])
            raise

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

    def _call(
        self, header: dict[str, Any], frames: Sequence[Buffer] = (), wait: float = 0.0
    ) -> tuple[dict[str, Any], list[Any]]:
        return self._request(header, frames, wait, self._request_timeout, self._retries)

    def _request(
        self,
        header: dict[str, Any],
        frames: Sequence[Buffer],
        wait: float,
        timeout: float,
        retries: int,
    ) -> tuple[dict[str, Any], list[Any]]:
        """Send and wait ``wait + timeout`` seconds per attempt; raise on an error reply."""
        with self._lock:
            if self._closed:
                raise TransferQueueError(f"client for {self.address} is closed")
            req_id = next(self._ids)
            head = pack_header({"v": WIRE_VERSION, "id": req_id, "s": self.session, "c": self.consumer_id, **header})
            for _attempt in range(1 + retries):
                self._sock.send_multipart([head, *frames], copy=False)
                answer = self._await(req_id, wait + timeout)
                if answer is not None:
                    return _check_reply(answer, header["op"], self.address)
        raise TransferUnreachableError(
            f"transfer queue at {self.address} did not answer within {timeout:g}s "
            f"({1 + retries} attempt(s)); is the driver running? Check the driver's log, and "
            "that this address (from the job's cluster.json) is reachable from this node"
        )

    def _await(self, req_id: int, seconds: float) -> tuple[dict[str, Any], list[Any]] | None:
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(left * 1000, zmq.POLLIN):
                return None
            frames = self._sock.recv_multipart(copy=False)
            try:
                reply = unpack_header(frames[0])
            except WireError:
                continue
            if reply.get("id") == req_id:  # anything else answers an earlier, retried request
                return reply, frames[1:]


def _check_reply(answer: tuple[dict[str, Any], list[Any]], op: str, address: str) -> tuple[dict[str, Any], list[Any]]:
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
