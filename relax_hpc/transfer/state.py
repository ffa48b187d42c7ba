"""The queue's bookkeeping as a single-threaded, non-blocking state machine.

Both implementations share it: :class:`~relax_hpc.transfer.memory.InMemoryTransferQueue` wraps
it in a ``threading.Condition`` and the ZMQ server drives it from its event loop, parking the
requests that cannot be answered yet. Values are opaque (``V``): the in-memory queue stores the
caller's tensors, the server stores encoded frames it never decodes.

Per (partition, task) it keeps which rows were acked and which are in flight to which consumer
session, so delivery is exactly-once per task across consumer restarts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from relax_hpc.transfer.queue import (
    PartitionInfo,
    TransferQueueError,
    partition_step,
    staleness_allows,
)

V = TypeVar("V")
Owner = tuple[str, str]  # (consumer_id, session)


@dataclass(frozen=True)
class Taken(Generic[V]):
    """Rows handed to a task by :meth:`QueueState.try_get`."""

    indices: list[int]
    rows: list[dict[str, V]]
    end: bool


@dataclass
class _Delivery:
    """What one task has received from one partition."""

    acked: set[int] = field(default_factory=set)
    in_flight: dict[int, Owner] = field(default_factory=dict)
    low: int = 0  # every row below this index is acked or in flight

    def delivered(self, index: int) -> bool:
        return index in self.in_flight or index in self.acked

    def advance(self) -> None:
        while self.delivered(self.low):
            self.low += 1


@dataclass
class _Partition(Generic[V]):
    seq: int
    rows: list[dict[str, V]] = field(default_factory=list)
    expected: int | None = None
    deliveries: dict[str, _Delivery] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.expected is not None and len(self.rows) == self.expected


class QueueState(Generic[V]):
    """Partitions, rows, deliveries and the capacity count. Not thread-safe by itself."""

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 rows or None (unbounded), got {capacity}")
        self.capacity = capacity
        self.held = 0
        self.aborted: str | None = None  # why an in-process queue stopped (InMemoryTransferQueue.abort)
        self._parts: dict[str, _Partition[V]] = {}
        self._cleared: set[str] = set()
        self._seq = itertools.count()
        self._owners: dict[tuple[str, str], str] = {}  # (task, consumer_id) -> live session
        self._fenced: set[tuple[str, str, str]] = set()

    # ----------------------------------------------------------------- producers
    def check_put(self, partition: str, n_rows: int) -> None:
        """Raise for a put that can never succeed (waiting would not help)."""
        if partition in self._cleared:
            raise TransferQueueError(
                f"partition {partition!r} was cleared; partition names are not reused, "
                "put into the next step's partition"
            )
        if self.capacity is not None and n_rows > self.capacity:
            raise TransferQueueError(
                f"a put of {n_rows} rows can never fit in a queue of capacity {self.capacity} "
                "rows; put fewer rows per call or raise the capacity "
                "(rollout_batch_size * (max_staleness + 1) * n_samples_per_prompt)"
            )
        part = self._parts.get(partition)
        if part is not None and part.expected is not None and len(part.rows) + n_rows > part.expected:
            raise TransferQueueError(
                f"partition {partition!r} was completed with {part.expected} rows and holds "
                f"{len(part.rows)}; a put of {n_rows} more would exceed it"
            )

    def has_room(self, n_rows: int) -> bool:
        return self.capacity is None or self.held + n_rows <= self.capacity

    def capacity_message(self, partition: str, n_rows: int, waited: float) -> str:
        oldest = min(self._parts, key=self._order_key, default=None)
        return (
            f"put of {n_rows} rows into {partition!r} waited {waited:.1f}s: the queue holds "
            f"{self.held} rows and its capacity is {self.capacity}; the actor must clear a "
            f"partition (oldest uncleared: {oldest!r}) or the capacity must grow"
        )

    def put(self, partition: str, rows: Sequence[dict[str, V]]) -> list[int]:
        """Append rows (call :meth:`check_put` and :meth:`has_room` first)."""
        self.check_put(partition, len(rows))
        part = self._parts.get(partition)
        if part is None:
            part = self._parts[partition] = _Partition(seq=next(self._seq))
        start = len(part.rows)
        part.rows.extend(dict(row) for row in rows)
        self.held += len(rows)
        return list(range(start, start + len(rows)))

    def write(self, partition: str, indices: Sequence[int], rows: Sequence[dict[str, V]]) -> None:
        if len(indices) != len(rows):
            raise TransferQueueError(
                f"write to {partition!r}: {len(indices)} indices but {len(rows)} rows; "
                "pass one row dict per index"
            )
        part = self._live(partition, "write to")
        for index in indices:
            if not isinstance(index, int) or not 0 <= index < len(part.rows):
                raise TransferQueueError(
                    f"write to {partition!r}: row index {index!r} does not exist "
                    f"(the partition holds rows 0..{len(part.rows) - 1})"
                )
        for index, row in zip(indices, rows):
            part.rows[index].update(row)

    def complete(self, partition: str, total_rows: int) -> None:
        if partition in self._cleared:
            raise TransferQueueError(f"cannot complete partition {partition!r}: it was cleared")
        if not isinstance(total_rows, int) or total_rows < 0:
            raise TransferQueueError(f"complete({partition!r}): total_rows must be an int >= 0, got {total_rows!r}")
        part = self._parts.get(partition)
        if part is None:
            part = self._parts[partition] = _Partition(seq=next(self._seq))
        if part.expected is not None and part.expected != total_rows:
            raise TransferQueueError(
                f"partition {partition!r} was already completed with {part.expected} rows, "
                f"not {total_rows}"
            )
        if len(part.rows) > total_rows:
            raise TransferQueueError(
                f"complete({partition!r}, {total_rows}): it already holds {len(part.rows)} rows"
            )
        part.expected = total_rows

    def clear(self, partition: str) -> int:
        self._cleared.add(partition)
        part = self._parts.pop(partition, None)
        if part is None:
            return 0
        self.held -= len(part.rows)
        return len(part.rows)

    # ----------------------------------------------------------------- consumers
    def try_get(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        owner: Owner,
    ) -> Taken[V] | None:
        """Hand out rows now, or None when the caller has to wait."""
        if batch_size < 1:
            raise TransferQueueError(f"get from {partition!r}: batch_size must be >= 1, got {batch_size}")
        self.claim(task, owner)
        if partition in self._cleared:
            return Taken([], [], end=True)
        part = self._parts.get(partition)
        if part is None:
            return None
        delivery = part.deliveries.setdefault(task, _Delivery())
        chosen: list[int] = []
        waiting = 0  # undelivered rows still missing a field
        for index in range(delivery.low, len(part.rows)):
            if delivery.delivered(index):
                continue
            row = part.rows[index]
            if all(name in row for name in fields):
                chosen.append(index)
                if len(chosen) == batch_size:
                    break
            else:
                waiting += 1
        if len(chosen) < batch_size and not (part.complete and waiting == 0):
            return None
        for index in chosen:
            delivery.in_flight[index] = owner
        delivery.advance()
        n_delivered = len(delivery.acked) + len(delivery.in_flight)
        end = part.complete and n_delivered == len(part.rows)
        picked = [self._pick(part.rows[i], fields) for i in chosen]
        return Taken(chosen, picked, end)

    def ack(self, partition: str, task: str, indices: Sequence[int], owner: Owner) -> int:
        self.claim(task, owner)
        part = self._parts.get(partition)
        if part is None:
            return 0
        delivery = part.deliveries.get(task)
        if delivery is None:
            delivery = part.deliveries[task] = _Delivery()
        newly = 0
        for index in indices:
            if index in delivery.acked:
                continue
            if delivery.in_flight.get(index) != owner:
                raise TransferQueueError(
                    f"ack of row {index} of {partition!r} for task {task!r}: this session never "
                    "received it (or it was handed to a newer session of the same consumer)"
                )
            del delivery.in_flight[index]
            delivery.acked.add(index)
            newly += 1
        return newly

    def claim(self, task: str, owner: Owner) -> None:
        """Make ``owner``'s session the live one for (task, consumer_id).

        A new session of a known consumer means that consumer restarted: rows the old session
        received but never acked go back to the pool, and the old session is fenced off.
        """
        consumer, session = owner
        if (task, consumer, session) in self._fenced:
            raise TransferQueueError(
                f"this session of consumer {consumer!r} for task {task!r} was replaced by a newer "
                "one; each consumer_id may be used by one live client at a time (give concurrent "
                "consumers of one task distinct consumer_id values)"
            )
        previous = self._owners.get((task, consumer))
        if previous == session:
            return
        self._owners[(task, consumer)] = session
        if previous is None:
            return
        self._fenced.add((task, consumer, previous))
        for part in self._parts.values():
            delivery = part.deliveries.get(task)
            if delivery is None:
                continue
            stale = [i for i, held_by in delivery.in_flight.items() if held_by[0] == consumer]
            for index in stale:
                del delivery.in_flight[index]
                delivery.low = min(delivery.low, index)

    # ----------------------------------------------------------------- staleness, listing
    def partitions(self) -> list[PartitionInfo]:
        infos = []
        for name in sorted(self._parts, key=self._order_key):
            part = self._parts[name]
            common: set[str] = set(part.rows[0]) if part.rows else set()
            for row in part.rows[1:]:
                common &= row.keys()
            infos.append(PartitionInfo(name, len(part.rows), part.expected, part.complete, sorted(common)))
        return infos

    def oldest_uncleared(self) -> int | None:
        steps = [s for s in (partition_step(name) for name in self._parts) if s is not None]
        return min(steps, default=None)

    def may_start(self, step: int, max_staleness: int) -> bool:
        return staleness_allows(step, self.oldest_uncleared(), max_staleness)

    # ----------------------------------------------------------------- helpers
    def _live(self, partition: str, verb: str) -> _Partition[V]:
        part = self._parts.get(partition)
        if part is None:
            state = "was cleared" if partition in self._cleared else "does not exist"
            raise TransferQueueError(f"cannot {verb} partition {partition!r}: it {state}")
        return part

    def _order_key(self, name: str) -> tuple[int, int, int]:
        step = partition_step(name)
        part = self._parts[name]
        return (0, step, part.seq) if step is not None else (1, 0, part.seq)

    @staticmethod
    def _pick(row: dict[str, V], fields: Sequence[str]) -> dict[str, V]:
        if not fields:
            return dict(row)
        return {name: row[name] for name in fields}
