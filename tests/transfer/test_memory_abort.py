"""`InMemoryTransferQueue.abort`: a role that feeds an in-process queue failed, so every call
waiting on the queue (any session) stops with that role's error instead of its timeout.

The waits below have 600 s timeouts: a call that were not woken would hang the test (and the
test's timeout would fail it), so each passing test shows the abort itself ended the wait."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest

from relax_hpc.transfer import InMemoryTransferQueue
from relax_hpc.transfer.connect import report_failure
from relax_hpc.transfer.queue import TransferAbortedError

LONG = 600.0


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, raised


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", ["get", "put", "staleness"])
def test_a_waiting_call_of_another_session_stops_with_the_reason(wait: str) -> None:
    queue = InMemoryTransferQueue(capacity=2)
    consumer = queue.open_session("trainer")
    if wait == "put":
        queue.put("train_0", [{"x": 1}, {"x": 2}])  # full: the next put waits for room
    if wait == "staleness":
        queue.put("train_0", [{"x": 1}])  # step 0 uncleared: step 2 may not start at staleness 1
    calls = {
        "get": lambda: consumer.get("train_0", "train", ["x"], 1, timeout=LONG),
        "put": lambda: consumer.put("train_0", [{"x": 3}], timeout=LONG),
        "staleness": lambda: consumer.wait_until_may_start(2, 1, timeout=LONG),
    }
    thread, raised = _in_thread(calls[wait])
    report_failure(queue, "rollout producer failed: ValueError: bad prompt")
    thread.join(LONG)
    assert [type(e) for e in raised] == [TransferAbortedError]
    assert "the queue stopped: rollout producer failed: ValueError: bad prompt" in str(raised[0])


def test_rows_there_are_still_handed_out_and_the_first_reason_stays() -> None:
    queue = InMemoryTransferQueue()
    queue.put("train_0", [{"x": 1}])
    queue.abort("forward failed: OSError: disk")
    queue.abort("rollout producer failed: a later error")
    batch = queue.get("train_0", "train", ["x"], 1, timeout=LONG)
    assert [row["x"] for row in batch.rows] == [1]
    with pytest.raises(TransferAbortedError, match="forward failed: OSError: disk"):
        queue.get("train_0", "train", ["x"], 1, timeout=LONG)


def test_a_zmq_address_is_left_to_the_driver() -> None:
    report_failure("tcp://127.0.0.1:1", "rollout producer failed")  # nothing to stop, nothing raised
