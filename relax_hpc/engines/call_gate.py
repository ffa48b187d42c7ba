"""The pause gate an engine puts around its `generate` calls.

    gate = CallGate()
    with gate.admit(check):   # waits while paused; `check()` runs under the lock before entry
        ...                   # the generate call
    gate.pause()              # closes the gate and waits for the calls in flight
    gate.resume()

`gate.lock` is the condition itself, for engine state that must not change under a call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["CallGate"]


class CallGate:
    """Generate calls pass while open; `pause` holds new ones and waits for those in flight."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self._paused = False
        self._in_flight = 0

    @contextlib.contextmanager
    def admit(self, check: Callable[[], None] | None = None) -> Iterator[None]:
        with self.lock:
            self.lock.wait_for(lambda: not self._paused)
            if check is not None:
                check()
            self._in_flight += 1
        try:
            yield
        finally:
            with self.lock:
                self._in_flight -= 1
                self.lock.notify_all()

    def pause(self) -> None:
        with self.lock:
            self._paused = True
            self.lock.wait_for(lambda: self._in_flight == 0)

    def resume(self) -> None:
        with self.lock:
            self._paused = False
            self.lock.notify_all()
