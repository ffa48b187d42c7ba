"""StepShipper: steps reach the queue whole and in order, one in flight, errors reach the producer."""

from __future__ import annotations

import threading
from typing import Any, Sequence

import pytest
import torch

from relax_hpc.roles.shipping import StepShipper
from relax_hpc.transfer import InMemoryTransferQueue, partition_name


def rows(n: int, first: int = 0) -> list[dict[str, Any]]:
    return [{"tokens": torch.tensor([first + k]), "group_id": first + k} for k in range(n)]


class RecordingQueue:
    """A queue session that records its calls; puts of `hold_step` wait for `release`."""

    def __init__(self, hold_step: int | None = None, fail_step: int | None = None) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.hold_step, self.fail_step = hold_step, fail_step
        self.release, self.holding = threading.Event(), threading.Event()
        self.closed = False

    def put(self, partition: str, rows: Sequence[dict[str, Any]], timeout: float = 60.0) -> list[int]:
        if self.hold_step is not None and partition == partition_name(self.hold_step):
            self.holding.set()
            assert self.release.wait(10)
        if self.fail_step is not None and partition == partition_name(self.fail_step):
            raise TimeoutError(f"put to {partition} timed out")
        self.calls.append(("put", partition, len(rows)))
        return list(range(len(rows)))

    def complete(self, partition: str, total_rows: int) -> None:
        self.calls.append(("complete", partition, total_rows))

    def close(self) -> None:
        self.closed = True


def test_each_step_is_put_then_completed_in_step_order() -> None:
    queue = InMemoryTransferQueue()
    shipper = StepShipper(queue.open_session("ship"), timeout_s=10)
    for step in range(3):
        shipper.ship(step, lambda step=step: rows(4, first=10 * step))
    shipper.close()
    info = {p.name: p for p in queue.partitions()}
    assert [info[partition_name(s)].rows for s in range(3)] == [4, 4, 4]
    assert all(info[partition_name(s)].complete for s in range(3))
    got = queue.get(partition_name(2), "train", ["group_id"], batch_size=4, timeout=1)
    assert sorted(int(g) for g in got.column("group_id")) == [20, 21, 22, 23] and got.end


def test_the_next_step_waits_until_the_one_in_flight_is_on_the_queue() -> None:
    queue = RecordingQueue(hold_step=0)
    shipper = StepShipper(queue, timeout_s=10)
    shipper.ship(0, lambda: rows(2))
    assert queue.holding.wait(10)
    second = threading.Thread(target=shipper.ship, args=(1, lambda: rows(3)))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # held: step 0 is not on the queue yet
    assert queue.calls == []
    queue.release.set()
    second.join(10)
    shipper.close()
    assert queue.calls == [("put", partition_name(0), 2), ("complete", partition_name(0), 2),
                           ("put", partition_name(1), 3), ("complete", partition_name(1), 3)]
    assert queue.closed


def test_a_failed_put_is_raised_by_the_next_ship_and_the_step_after_is_not_sent() -> None:
    queue = RecordingQueue(fail_step=0)
    shipper = StepShipper(queue, timeout_s=10)
    shipper.ship(0, lambda: rows(2))
    with pytest.raises(TimeoutError, match="put to .* timed out"):
        shipper.ship(1, lambda: rows(2))
    shipper.close()
    assert queue.calls == [] and queue.closed


def test_failure_reports_the_error_of_the_step_in_flight_once_it_has_failed() -> None:
    queue = RecordingQueue(fail_step=0)
    shipper = StepShipper(queue, timeout_s=10)
    assert shipper.failure() is None
    shipper.ship(0, lambda: rows(1))
    with pytest.raises(TimeoutError):
        shipper.wait()
    assert shipper.failure() is None  # raised once, by wait
    shipper.ship(1, lambda: rows(1))
    shipper.close()
    assert queue.calls == [("put", partition_name(1), 1), ("complete", partition_name(1), 1)]


def test_close_raises_the_last_steps_error_and_still_closes_the_session() -> None:
    queue = RecordingQueue(fail_step=0)
    shipper = StepShipper(queue, timeout_s=10)
    shipper.ship(0, lambda: rows(1))
    with pytest.raises(TimeoutError):
        shipper.close()
    assert queue.closed


def test_rows_are_built_on_the_shipper_thread() -> None:
    queue = RecordingQueue()
    shipper = StepShipper(queue, timeout_s=10, name="ship-test")
    seen: list[str] = []
    shipper.ship(0, lambda: seen.append(threading.current_thread().name) or rows(1))
    shipper.close()
    assert len(seen) == 1 and seen[0].startswith("ship-test")


def test_the_step_in_flight_is_named_until_it_is_on_the_queue() -> None:
    queue = RecordingQueue(hold_step=0)
    shipper = StepShipper(queue, timeout_s=10)
    assert shipper.in_flight_step is None
    shipper.ship(0, lambda: rows(2))
    assert queue.holding.wait(10)
    assert shipper.in_flight_step == 0 and queue.calls == []  # handed over, its partition not there yet
    queue.release.set()
    shipper.wait()
    assert shipper.in_flight_step is None and queue.calls[-1] == ("complete", partition_name(0), 2)
    shipper.close()
