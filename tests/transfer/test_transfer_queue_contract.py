"""The TransferQueue contract, run against the in-memory queue and the ZMQ server/client."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from transfer_harness import QueueHarness

from relax_hpc.transfer import TransferQueue, TransferQueueError, TransferTimeoutError

T = TypeVar("T")
BLOCKED_S = 0.3  # how long a call must stay blocked to count as "blocks"


def in_thread(fn: Callable[[], T]) -> Future[T]:
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def rows(n: int, start: int = 0, **extra: Any) -> list[dict[str, Any]]:
    return [{"tokens": torch.full((3,), start + i, dtype=torch.int64), "uid": start + i, **extra} for i in range(n)]


def uids(batch_rows: list[dict[str, Any]]) -> list[int]:
    return [int(r["uid"]) for r in batch_rows]


def test_put_numbers_rows_per_partition(harness: QueueHarness) -> None:
    q = harness.start()
    assert q.put("train_0", rows(3)) == [0, 1, 2]
    assert q.put("train_1", rows(2)) == [0, 1]
    assert q.put("train_0", rows(2, start=3)) == [3, 4]
    infos = {p.name: p for p in q.partitions()}
    assert [p.name for p in q.partitions()] == ["train_0", "train_1"]
    assert infos["train_0"].rows == 5 and not infos["train_0"].complete
    assert infos["train_0"].fields == ["tokens", "uid"]


def test_exactly_once_per_task_with_concurrent_consumers(harness: QueueHarness) -> None:
    q = harness.start()
    n_rows, tasks = 60, ["actor_fwd", "reference", "actor"]
    consumers = {task: harness.handle() for task in tasks}
    producer = harness.handle()

    def produce() -> None:
        for start in range(0, n_rows, 7):
            producer.put("train_0", rows(min(7, n_rows - start), start=start))
            time.sleep(0.005)
        producer.complete("train_0", n_rows)

    def consume(task: str) -> list[int]:
        seen: list[int] = []
        handle = consumers[task]
        while True:
            batch = handle.get("train_0", task, ["tokens", "uid"], 8, timeout=10)
            assert batch.indices == uids(batch.rows)  # row index i carries uid i
            seen.extend(batch.indices)
            handle.ack("train_0", task, batch.indices)
            if batch.end:
                return seen

    futures = {task: in_thread(lambda task=task: consume(task)) for task in tasks}  # type: ignore[misc]
    produce()
    for task, future in futures.items():
        seen = future.result(timeout=20)
        assert sorted(seen) == list(range(n_rows)), task
        assert len(seen) == len(set(seen)), task


def test_consumer_blocked_on_missing_field_wakes_on_write(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(4))
    consumer, writer = harness.handle(), harness.handle()
    # rows exist but lack log_probs: the actor must wait for ActorFwd
    future = in_thread(lambda: consumer.get("train_0", "actor", ["tokens", "log_probs"], 2, timeout=10))
    time.sleep(BLOCKED_S)
    assert not future.done()
    writer.write("train_0", [1], [{"log_probs": torch.zeros(3)}])
    time.sleep(0.1)
    assert not future.done()  # one ready row is not a batch of two
    writer.write("train_0", [3], [{"log_probs": torch.ones(3)}])
    batch = future.result(timeout=5)
    assert batch.indices == [1, 3]
    assert torch.equal(batch.rows[1]["log_probs"], torch.ones(3))
    assert set(batch.rows[0]) == {"tokens", "log_probs"}


def test_complete_gives_short_batch_then_end(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(5))
    q.complete("train_0", 5)
    first = q.get("train_0", "actor", ["uid"], 4, timeout=5)
    assert (first.indices, first.end) == ([0, 1, 2, 3], False)
    short = q.get("train_0", "actor", ["uid"], 4, timeout=5)
    assert (short.indices, short.end) == ([4], True)
    after = q.get("train_0", "actor", ["uid"], 4, timeout=5)
    assert (after.indices, after.rows, after.end) == ([], [], True)
    assert q.partitions()[0].complete


def test_complete_waits_for_missing_fields_and_rows(harness: QueueHarness) -> None:
    q = harness.start()
    q.complete("train_0", 3)  # declared up front: consumers wait for the rows
    consumer = harness.handle()
    future = in_thread(lambda: consumer.get("train_0", "actor", ["uid"], 8, timeout=10))
    time.sleep(BLOCKED_S)
    assert not future.done()
    q.put("train_0", rows(3))
    batch = future.result(timeout=5)
    assert (batch.indices, batch.end) == ([0, 1, 2], True)
    with pytest.raises(TransferQueueError, match="completed with 3 rows"):
        q.put("train_0", rows(1))


def test_get_timeout_consumes_nothing(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(2))
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="train_0"):
        q.get("train_0", "actor", ["uid"], 3, timeout=0.2)
    assert time.monotonic() - t0 >= 0.19
    assert q.get("train_0", "actor", ["uid"], 2, timeout=1).indices == [0, 1]


def test_get_waits_for_a_partition_that_does_not_exist_yet(harness: QueueHarness) -> None:
    q = harness.start()
    consumer = harness.handle()
    future = in_thread(lambda: consumer.get("train_4", "actor", ["uid"], 1, timeout=10))
    time.sleep(BLOCKED_S)
    assert not future.done()
    q.put("train_4", rows(1, start=40))
    assert uids(future.result(timeout=5).rows) == [40]


def test_clear_frees_rows_and_ends_consumers(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(4))
    q.put("train_1", rows(2))
    assert q.clear("train_0") == 4
    assert [p.name for p in q.partitions()] == ["train_1"]
    batch = q.get("train_0", "actor", ["uid"], 2, timeout=1)
    assert (batch.indices, batch.end) == ([], True)
    with pytest.raises(TransferQueueError, match="was cleared"):
        q.put("train_0", rows(1))
    with pytest.raises(TransferQueueError, match="was cleared"):
        q.write("train_0", [0], [{"x": 1}])
    assert q.clear("train_9") == 0  # clearing an unknown partition is harmless


def test_capacity_blocks_then_unblocks(harness: QueueHarness) -> None:
    q = harness.start(capacity=4)
    q.put("train_0", rows(3))
    producer = harness.handle()
    future = in_thread(lambda: producer.put("train_1", rows(2), timeout=10))
    time.sleep(BLOCKED_S)
    assert not future.done()  # 3 + 2 > 4
    q.clear("train_0")
    assert future.result(timeout=5) == [0, 1]
    with pytest.raises(TransferTimeoutError, match="capacity is 4"):
        q.put("train_2", rows(3), timeout=0.2)  # 2 + 3 > 4
    with pytest.raises(TransferQueueError, match="can never fit"):
        q.put("train_2", rows(5), timeout=5)
    assert [p.name for p in q.partitions()] == ["train_1"]  # the failed puts left nothing


def test_staleness_zero_is_strict_on_policy(harness: QueueHarness) -> None:
    q = harness.start()
    assert q.may_start(0, 0) and q.oldest_uncleared() is None
    q.put("train_0", rows(1))
    q.put("eval_7", rows(1))  # only train_<id> partitions pace rollout
    assert q.oldest_uncleared() == 0
    assert not q.may_start(1, 0)  # 1 - 0 = 1 > 0
    rollout = harness.handle()
    future = in_thread(lambda: rollout.wait_until_may_start(1, 0, timeout=10))
    time.sleep(BLOCKED_S)
    assert not future.done()
    q.clear("train_0")
    future.result(timeout=5)
    assert q.may_start(1, 0) and q.oldest_uncleared() is None


def test_staleness_one_allows_one_step_ahead(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(1))
    assert q.may_start(1, 1)  # 1 - 0 = 1 <= 1
    q.put("train_1", rows(1))
    assert not q.may_start(2, 1)  # 2 - 0 = 2 > 1
    with pytest.raises(TransferTimeoutError, match="max_staleness=1"):
        q.wait_until_may_start(2, 1, timeout=0.2)
    rollout = harness.handle()
    future = in_thread(lambda: rollout.wait_until_may_start(2, 1, timeout=10))
    time.sleep(BLOCKED_S)
    assert not future.done()
    q.clear("train_0")
    future.result(timeout=5)
    assert q.oldest_uncleared() == 1 and q.may_start(2, 1) and not q.may_start(3, 1)


def test_restarted_consumer_gets_unacked_rows_once(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(10))
    q.complete("train_0", 10)
    first = harness.handle()
    got = first.get("train_0", "actor", ["uid"], 4, timeout=5)
    first.ack("train_0", "actor", got.indices[:2])  # rows 0, 1 are done
    first.get("train_0", "actor", ["uid"], 3, timeout=5)  # rows 4..6 received, never acked
    first.close()  # the consumer dies here

    restarted = harness.handle()
    seen: list[int] = []
    while True:
        batch = restarted.get("train_0", "actor", ["uid"], 3, timeout=5)
        seen.extend(batch.indices)
        restarted.ack("train_0", "actor", batch.indices)
        if batch.end:
            break
    assert sorted(seen) == list(range(2, 10))  # un-acked rows come back, acked ones never
    assert len(seen) == len(set(seen))
    # another task was never affected
    assert q.get("train_0", "reference", ["uid"], 10, timeout=5).indices == list(range(10))


def test_get_acks_the_previous_batch_in_the_same_request(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(6))
    q.complete("train_0", 6)
    first = harness.handle()
    a = first.get("train_0", "actor", ["uid"], 2, timeout=5)
    b = first.get("train_0", "actor", ["uid"], 2, timeout=5, ack=a.indices)  # rows 0, 1 acked here
    first.close()  # dies holding rows 2, 3 (received, never acked)

    restarted = harness.handle()
    seen: list[int] = []
    done: list[int] = []
    while True:
        batch = restarted.get("train_0", "actor", ["uid"], 3, timeout=5, ack=done)
        seen.extend(batch.indices)
        done = batch.indices
        if batch.end:
            break
    assert b.indices == [2, 3]
    assert sorted(seen) == [2, 3, 4, 5]  # acked rows never come back, unacked ones once


def test_ack_riding_on_a_get_stands_when_the_get_times_out(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(2))
    first = harness.handle()
    got = first.get("train_0", "actor", ["uid"], 2, timeout=5)
    with pytest.raises(TransferTimeoutError):
        first.get("train_0", "actor", ["uid"], 1, timeout=0.2, ack=got.indices)
    first.close()
    q.complete("train_0", 2)
    assert harness.handle().get("train_0", "actor", ["uid"], 5, timeout=5).indices == []  # nothing owed again


def test_get_refuses_an_ack_of_rows_it_never_received(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(3))
    with pytest.raises(TransferQueueError):
        q.get("train_0", "actor", ["uid"], 1, timeout=1, ack=[2])
    assert q.get("train_0", "actor", ["uid"], 3, timeout=5).indices == [0, 1, 2]


def test_stream_delivers_each_row_once_as_it_is_produced_and_acks_it(harness: QueueHarness) -> None:
    q = harness.start()
    producer, consumer = harness.handle(), harness.handle()

    def produce() -> None:
        for start in range(0, 20, 5):
            producer.put("train_0", rows(5, start=start))
            time.sleep(0.02)
        producer.complete("train_0", 20)

    feeding = in_thread(produce)
    batches = list(consumer.stream("train_0", "actor", ["uid"], 3, timeout=5))
    feeding.result(timeout=5)
    seen = [u for b in batches for u in uids(b.rows)]
    assert sorted(seen) == list(range(20)) and len(seen) == 20
    assert batches[-1].end and not any(b.end for b in batches[:-1])
    consumer.close()
    # everything was acked: a restarted consumer is owed nothing
    assert harness.handle().get("train_0", "actor", ["uid"], 20, timeout=5).indices == []


def test_stream_left_early_acks_only_what_was_asked_past(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(12))
    q.complete("train_0", 12)
    first = harness.handle()
    done: list[int] = []
    for batch in first.stream("train_0", "actor", ["uid"], 3, timeout=5):
        if len(done) == 6:  # rows 0..5 were asked past; rows 6..8 are in hand when it leaves
            break
        done.extend(batch.indices)
    first.close()
    restarted = harness.handle()
    again = [i for b in restarted.stream("train_0", "actor", ["uid"], 12, timeout=5) for i in b.indices]
    assert not set(again) & set(done)  # acked rows never come back
    assert sorted(again + done) == list(range(12))  # and nothing is lost


def test_stream_without_ack_leaves_acking_to_the_caller(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(5))
    q.complete("train_0", 5)
    first = harness.handle()
    got = [i for b in first.stream("train_0", "actor", ["uid"], 2, timeout=5, ack=False) for i in b.indices]
    assert got == [0, 1, 2, 3, 4]
    first.ack("train_0", "actor", got[:2])
    first.close()
    assert harness.handle().get("train_0", "actor", ["uid"], 5, timeout=5).indices == [2, 3, 4]


def test_stream_timeout_raises_and_keeps_what_was_asked_past(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(4))  # never completed: the stream runs dry after row 3
    first = harness.handle()
    stream = first.stream("train_0", "actor", ["uid"], 2, timeout=0.3)
    assert next(stream).indices == [0, 1]
    assert next(stream).indices == [2, 3]  # asking for it finished rows 0, 1
    with pytest.raises(TransferTimeoutError):
        next(stream)  # finished rows 2, 3, then no row came
    first.close()
    q.complete("train_0", 4)
    assert harness.handle().get("train_0", "actor", ["uid"], 4, timeout=5).indices == []


def test_prefetched_stream_delivers_rows_put_later_exactly_once(harness: QueueHarness) -> None:
    q = harness.start()
    consumer = harness.handle()
    consumer.prefetch("train_1", "actor", ["uid"], 4, timeout=5)  # the partition does not exist yet
    consumer.prefetch("train_1", "actor", ["uid"], 4, timeout=5)  # asking twice asks once
    q.put("train_0", rows(3))
    q.complete("train_0", 3)
    # another partition streams meanwhile; the prefetched request waits on the server
    assert [i for b in consumer.stream("train_0", "actor", ["uid"], 2, timeout=5) for i in b.indices] == [0, 1, 2]
    q.put("train_1", rows(6, start=10))
    q.complete("train_1", 6)
    batches = list(consumer.stream("train_1", "actor", ["uid"], 4, timeout=5))
    assert [uids(b.rows) for b in batches] == [[10, 11, 12, 13], [14, 15]] and batches[-1].end
    consumer.close()
    assert harness.handle().get("train_1", "actor", ["uid"], 6, timeout=5).indices == []  # all acked


def test_a_prefetch_that_timed_out_is_asked_again_by_its_stream(harness: QueueHarness) -> None:
    q = harness.start()
    consumer = harness.handle()
    consumer.prefetch("train_0", "actor", ["uid"], 2, timeout=0.2)
    time.sleep(0.5)  # it has timed out on the server by now
    q.put("train_0", rows(2))
    q.complete("train_0", 2)
    got = [i for b in consumer.stream("train_0", "actor", ["uid"], 2, timeout=5) for i in b.indices]
    assert got == [0, 1]


def test_replaced_session_is_fenced(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(4))
    old, new = harness.handle(), harness.handle()
    stale = old.get("train_0", "actor", ["uid"], 2, timeout=5)
    assert new.get("train_0", "actor", ["uid"], 4, timeout=5).indices == [0, 1, 2, 3]
    with pytest.raises(TransferQueueError, match="replaced by a newer"):
        old.ack("train_0", "actor", stale.indices)
    assert new.ack("train_0", "actor", [0, 1, 2, 3]) == 4
    assert new.ack("train_0", "actor", [0]) == 0  # acking twice is harmless
    with pytest.raises(TransferQueueError, match="never received"):
        harness.handle().ack("train_0", "reference", [0])


def test_distinct_consumer_ids_share_a_task(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(6))
    rank0, rank1 = harness.handle("rank0"), harness.handle("rank1")
    a = rank0.get("train_0", "actor", ["uid"], 3, timeout=5)
    b = rank1.get("train_0", "actor", ["uid"], 3, timeout=5)
    assert sorted(a.indices + b.indices) == list(range(6))
    # rank1 restarts: only its own un-acked rows return
    rank0.ack("train_0", "actor", a.indices)
    rank1.close()
    again = harness.handle("rank1").get("train_0", "actor", ["uid"], 3, timeout=5)
    assert again.indices == b.indices


def test_values_round_trip(harness: QueueHarness) -> None:
    q = harness.start()
    row: dict[str, Any] = {
        "f32": torch.randn(2, 3),
        "bf16": torch.randn(4, 5).to(torch.bfloat16),
        "i64": torch.arange(7, dtype=torch.int64) - 3,
        "mask": torch.tensor([[True, False], [False, True]]),
        "f16": torch.randn(3).half(),
        "scalar_t": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
        "np_f64": np.linspace(0, 1, 5),
        "np_u8": np.arange(6, dtype=np.uint8).reshape(2, 3),
        "reward": 0.75,
        "step": 12,
        "ok": True,
        "prompt": "what is 2+2?",
        "none": None,
    }
    q.put("train_0", [row])
    got = harness.handle().get("train_0", "actor", list(row), 1, timeout=5).rows[0]
    for name, want in row.items():
        have = got[name]
        if isinstance(want, torch.Tensor):
            assert isinstance(have, torch.Tensor), name
            assert have.dtype == want.dtype and have.shape == want.shape, name
            assert torch.equal(have, want), name
        elif isinstance(want, np.ndarray):
            assert isinstance(have, np.ndarray), name
            assert have.dtype == want.dtype and have.shape == want.shape, name
            np.testing.assert_array_equal(have, want)
        else:
            assert have == want and type(have) is type(want), name


def test_bad_arguments_are_refused(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(2))
    with pytest.raises(TransferQueueError, match="does not exist"):
        q.write("train_0", [5], [{"x": 1}])
    with pytest.raises(TransferQueueError, match="does not exist"):
        q.write("train_3", [0], [{"x": 1}])
    with pytest.raises(TransferQueueError, match="cannot queue a list"):
        q.put("train_0", [{"bad": [1, 2]}])
    with pytest.raises(TransferQueueError, match="batch_size"):
        q.get("train_0", "actor", ["uid"], 0, timeout=1)
    with pytest.raises(TransferQueueError, match="wrap it in"):
        q.put("train_0", {"uid": 1})  # type: ignore[arg-type]
    with pytest.raises(TransferQueueError, match="already holds 2 rows"):
        q.complete("train_0", 1)


def test_implementations_satisfy_the_protocol(harness: QueueHarness) -> None:
    assert isinstance(harness.start(), TransferQueue)
    assert isinstance(harness.handle(), TransferQueue)


def test_many_threads_one_task_never_duplicate(harness: QueueHarness) -> None:
    q = harness.start()
    q.put("train_0", rows(40))
    q.complete("train_0", 40)
    handles = [harness.handle(f"w{i}") for i in range(4)]
    lock = threading.Lock()
    seen: list[int] = []

    def drain(handle: TransferQueue) -> None:
        while True:
            batch = handle.get("train_0", "actor", ["uid"], 3, timeout=5)
            handle.ack("train_0", "actor", batch.indices)
            with lock:
                seen.extend(batch.indices)
            if not batch.indices:
                return

    futures = [in_thread(lambda h=h: drain(h)) for h in handles]  # type: ignore[misc]
    for future in futures:
        future.result(timeout=20)
    assert sorted(seen) == list(range(40))
