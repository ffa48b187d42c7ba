"""Putting each generated step on the transfer queue while the next step generates.

Building a step's rows and putting them is the rollout role's own work, serial with nothing
else it must do: run after the step's last chunk, in the producer's thread, the engines would
idle meanwhile (at 256 simulated engines, 1.9 s of a 4.1 s step; docs/benchmarks.md, "Fleet
simulation"). `StepShipper` does it on a thread of its own, one step at a time and in step
order, so the producer goes on to the next step's staleness wait, weights and generation.

A step is handed over only once the step before is on the queue (`ship` waits for it first):
at most one step is in flight, the trainer finds every step's rows in order, and a failed put
is raised in the producer by the next `ship` or by `close`. `failure()` lets a caller see it
sooner. The shipper has a queue session of its own (a ZMQ socket serves one thread).
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Sequence

from relax_hpc.transfer import TransferQueue, partition_name
from relax_hpc.transfer.queue import Row

__all__ = ["StepShipper"]


class StepShipper:
    """Puts steps' rows on `queue` (a session only this shipper uses) from one background thread."""

    def __init__(self, queue: TransferQueue, timeout_s: float, name: str = "rollout-ship") -> None:
        self._queue = queue
        self._timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._in_flight: concurrent.futures.Future | None = None
        self._in_flight_step: int | None = None

    def ship(self, step: int, build_rows: Callable[[], Sequence[Row]]) -> None:
        """Wait until the step before is on the queue (raising its error), then build this
        step's rows with `build_rows` and put them and complete its partition, in the background."""
        self.wait()
        self._in_flight = self._pool.submit(self._put, step, build_rows)
        self._in_flight_step = step

    @property
    def in_flight_step(self) -> int | None:
        """The step handed over and not yet known to be on the queue (its partition may not exist
        yet, so the queue's staleness rule cannot count it); None when there is none."""
        return self._in_flight_step

    def wait(self) -> None:
        """Block until the step in flight, if any, is on the queue; raise what its put raised."""
        in_flight, self._in_flight = self._in_flight, None
        self._in_flight_step = None
        if in_flight is not None:
            in_flight.result()

    def failure(self) -> BaseException | None:
        """The error of the step in flight, once it has failed; None while it runs or after it succeeded."""
        in_flight = self._in_flight
        if in_flight is None or not in_flight.done():
            return None
        return in_flight.exception()

    def close(self) -> None:
        """Wait for the step in flight (its error is raised), then end the thread and the session."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self._queue.close()

    def _put(self, step: int, build_rows: Callable[[], Sequence[Row]]) -> None:
        rows = build_rows()  # a ColumnRows stays one: the queue sends its columns as they are
        partition = partition_name(step)
        self._queue.put(partition, rows, timeout=self._timeout_s)
        self._queue.complete(partition, len(rows))
