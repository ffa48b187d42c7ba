"""In-process transfer queue for tests and single-process runs (threads share one state).

Values are stored and returned as the caller's own objects (no copy): do not mutate a tensor
after putting it. ``open_session()`` gives another handle on the same queue, which is how tests
play a second process or a restarted consumer.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence

from relax_hpc.transfer.queue import (
    Batch,
    PartitionInfo,
    Row,
    TransferAbortedError,
    TransferTimeoutError,
    Value,
    check_name,
    check_rows,
)
from relax_hpc.transfer.state import QueueState


class InMemoryTransferQueue:
    """Thread-safe :class:`~relax_hpc.transfer.queue.TransferQueue` on a ``threading.Condition``."""

    def __init__(
        self,
        capacity: int | None = None,
        consumer_id: str = "",
        *,
        _shared: tuple[QueueState[Value], threading.Condition] | None = None,
    ) -> None:
        if _shared is None:
            _shared = (QueueState(capacity), threading.Condition())
        self._state, self._cond = _shared
        self._owner = (consumer_id, uuid.uuid4().hex)

    def open_session(self, consumer_id: str = "") -> InMemoryTransferQueue:
        """A new handle (new consumer session) on the same queue."""
        return InMemoryTransferQueue(consumer_id=consumer_id, _shared=(self._state, self._cond))

    @property
    def capacity(self) -> int | None:
        return self._state.capacity

    def put(self, partition: str, rows: Sequence[Row], timeout: float = 60.0) -> list[int]:
        check_name("partition", partition)
        check_rows(rows)
        deadline = time.monotonic() + timeout
        with self._cond:
            self._state.check_put(partition, len(rows))
            while not self._state.has_room(len(rows)):
                self._raise_if_aborted()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(self._state.capacity_message(partition, len(rows), timeout))
                self._cond.wait(left)
                self._state.check_put(partition, len(rows))
            indices = self._state.put(partition, [dict(row) for row in rows])
            self._cond.notify_all()
            return indices

    def write(self, partition: str, indices: Sequence[int], rows: Sequence[Row]) -> None:
        check_name("partition", partition)
        check_rows(rows)
        with self._cond:
            self._state.write(partition, list(indices), [dict(row) for row in rows])
            self._cond.notify_all()

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
        deadline = time.monotonic() + timeout
        with self._cond:
            if ack:
                self._state.ack(partition, task, list(ack), self._owner)
            while True:
                taken = self._state.try_get(partition, task, names, batch_size, self._owner)
                if taken is not None:
                    return Batch(partition, taken.indices, taken.rows, taken.end)
                self._raise_if_aborted()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(
                        f"get of {batch_size} rows with fields {names} from {partition!r} for "
                        f"task {task!r} timed out after {timeout:.1f}s; is the producer of "
                        "those fields running?"
                    )
                self._cond.wait(left)

    def stream(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        timeout: float = 60.0,
        ack: bool = True,
    ) -> Iterator[Batch]:
        finished: list[int] = []  # asked past: acked by the next get (it stands if that times out)
        try:
            while True:
                batch = self.get(partition, task, fields, batch_size, timeout, ack=finished)
                finished = []
                yield batch
                if ack:
                    finished = batch.indices
                if batch.end:
                    break
        finally:
            if finished:
                self.ack(partition, task, finished)

    def prefetch(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                 timeout: float = 60.0) -> None:
        """Nothing to do: in memory a get costs no round trip."""

    def ack(self, partition: str, task: str, indices: Sequence[int]) -> int:
        with self._cond:
            return self._state.ack(partition, task, list(indices), self._owner)

    def complete(self, partition: str, total_rows: int) -> None:
        check_name("partition", partition)
        with self._cond:
            self._state.complete(partition, total_rows)
            self._cond.notify_all()

    def clear(self, partition: str) -> int:
        check_name("partition", partition)
        with self._cond:
            freed = self._state.clear(partition)
            self._cond.notify_all()
            return freed

    def partitions(self) -> list[PartitionInfo]:
        with self._cond:
            return self._state.partitions()

    def oldest_uncleared(self) -> int | None:
        with self._cond:
            return self._state.oldest_uncleared()

    def may_start(self, step: int, max_staleness: int) -> bool:
        with self._cond:
            return self._state.may_start(step, max_staleness)

    def wait_until_may_start(self, step: int, max_staleness: int, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._state.may_start(step, max_staleness):
                self._raise_if_aborted()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeoutError(
                        f"rollout step {step} waited {timeout:.1f}s for the staleness bound "
                        f"(max_staleness={max_staleness}, oldest uncleared partition "
                        f"{self._state.oldest_uncleared()}); the actor has not cleared it"
                    )
                self._cond.wait(left)

    def abort(self, reason: str) -> None:
        """A role feeding this queue failed with `reason`: every call of every session that waits
        on the queue, now or later, raises TransferAbortedError(reason) rather than waiting out
        its timeout (rows it can take now are still handed out). In a Ray run the driver finds a
        failed role by polling; in one process the waiters would otherwise sleep through it."""
        with self._cond:
            if self._state.aborted is None:
                self._state.aborted = reason
            self._cond.notify_all()

    def _raise_if_aborted(self) -> None:
        if self._state.aborted is not None:
            raise TransferAbortedError(f"the queue stopped: {self._state.aborted}")

    def close(self) -> None:
        """Nothing to release; unacked rows stay owed to this consumer's next session."""

    def __enter__(self) -> InMemoryTransferQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
