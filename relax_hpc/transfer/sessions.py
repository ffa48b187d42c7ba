"""Which consumer id each session of the ZMQ queue speaks for.

A session (one client) names its consumer id in every request (header ``c``). The first request
fixes it: a later request of the same session naming another consumer id is refused, so one
session never holds rows of two consumers, and a session fenced off for one consumer id cannot
carry on under another. Taking over a consumer id, the restart path of a crashed worker, stays
what it was: a *new* session naming that id (docs/transfer-queue.md, "Ack and restarts");
only a holder of the job secret can open one.

Pure bookkeeping, used by the server's event loop; not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from relax_hpc.transfer.queue import TransferQueueError
from relax_hpc.transfer.wire import WireError

MAX_CONSUMER_LEN = 200
# Sessions remembered, least recently used dropped first. A session active at all stays; a
# forgotten one that comes back is bound afresh, which a new session could do anyway.
MAX_SESSIONS = 4096


class ConsumerMismatchError(TransferQueueError):
    """A request names another consumer id than its session's first request did."""


class SessionConsumers:
    """The consumer id of each session, fixed at its first request."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self._max_sessions = max_sessions
        self._consumers: OrderedDict[str, str] = OrderedDict()

    def bind(self, session: str, header: dict[str, Any]) -> str:
        """The consumer id of ``session``; the first call fixes it from ``header['c']``
        (default ""). Raises :class:`ConsumerMismatchError` when a later header names another."""
        consumer = header.get("c", "")
        if not isinstance(consumer, str) or len(consumer) > MAX_CONSUMER_LEN:
            raise WireError(f"header field 'c' (consumer id) must be a str of at most {MAX_CONSUMER_LEN} characters")
        bound = self._consumers.get(session)
        if bound is None:
            self._consumers[session] = consumer
            while len(self._consumers) > self._max_sessions:
                self._consumers.popitem(last=False)
        elif bound != consumer:
            raise ConsumerMismatchError(
                f"session {session!r} speaks for consumer {bound!r}, fixed by its first request; this "
                f"request names consumer {consumer!r}. A client is one session of one consumer_id: open "
                f"another TransferQueueClient(consumer_id={consumer!r}) for that consumer"
            )
        else:
            self._consumers.move_to_end(session)
        return consumer

    def __len__(self) -> int:
        return len(self._consumers)
