"""The loop shared by the roles that add fields to queued rows (ActorFwd, Reference, Advantages).

Each runs steps start_step..total_steps-1 on a background thread with its own queue client
(consumer id = its task name unless given), reports its first failure through `error()` for the
driver, and stops at the next boundary when asked. A subclass says what one step is
(`_process`) and, if it must, what it waits for before a step (`_ready_for`).
"""

from __future__ import annotations

import abc
import threading
from typing import Any

from relax_hpc.ops.heap import settle_heap
from relax_hpc.transfer.connect import connect_queue, report_failure


class StepLoopWorker(abc.ABC):
    """Base class: `start` / `stop` / `error` around a loop over steps."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # the queue task name
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: str | None = None
        self.rows_done = 0
        self.current_step: int | None = None

    def start(self, queue: Any, start_step: int, total_steps: int, consumer_id: str = "",
              start_version: int | None = None) -> None:
        """Process steps start_step..total_steps-1 in a background thread; `start_version` is the
        weight version the trainer starts from (default `start_step`)."""
        version = start_step if start_version is None else start_version
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, args=(queue, start_step, total_steps, consumer_id or self.kind, version),
            name=f"{self.kind}-loop", daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def error(self) -> str | None:
        return self._error

    def _run(self, target: Any, start_step: int, total_steps: int, consumer_id: str, start_version: int) -> None:
        queue = connect_queue(target, consumer_id)
        try:
            for step in range(start_step, total_steps):
                self.current_step = step
                if not self._ready_for(step, start_step, start_version) or not self._process(queue, step):
                    return
                settle_heap()  # once, after the first step: start-up is over
        except Exception as e:  # reported to the driver
            self._error = f"{self.kind} failed: {type(e).__name__}: {e}"
            report_failure(target, self._error)
        finally:
            queue.close()

    def doing(self) -> str:
        """What `relax-hpc status` shows for this role (relax_hpc/roles/heartbeat.py)."""
        if self._error:
            return "failed"
        return "idle" if self.current_step is None else f"step {self.current_step}, {self.rows_done} rows done"

    def _ready_for(self, step: int, start_step: int, start_version: int) -> bool:
        """Wait for whatever `step` needs; False when asked to stop. Nothing by default."""
        return True

    @abc.abstractmethod
    def _process(self, queue: Any, step: int) -> bool:
        """Handle every row of one step; False when asked to stop."""
