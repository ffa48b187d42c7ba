"""ZMQ-specific behaviour: unreachable servers, malformed frames, retries, zero-copy decoding."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq

from relax_hpc.auth import JobSecret
from relax_hpc.transfer import TransferQueueError, TransferUnreachableError
from relax_hpc.transfer.curve import queue_keys, set_client_keys
from relax_hpc.transfer.queue import TransferTimeoutError
from relax_hpc.transfer.wire import WIRE_VERSION
from relax_hpc.transfer.zmq_client import TransferQueueClient
from relax_hpc.transfer.zmq_server import TransferQueueServer

SECRET = JobSecret.generate()  # the servers' job secret; clients and raw sockets use its keys

@pytest.fixture
def server() -> Iterator[TransferQueueServer]:
    srv = TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, capacity=100)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def raw(server: TransferQueueServer) -> Iterator[zmq.Socket[Any]]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    set_client_keys(sock, queue_keys(SECRET))
    sock.connect(server.address)
    yield sock
    sock.close(0)


def exchange(sock: zmq.Socket[Any], frames: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
    sock.send_multipart(frames)
    assert sock.poll(5000), "server did not answer a malformed message"
    reply = sock.recv_multipart()
    return msgpack.unpackb(reply[0]), reply[1:]


def head(**fields: Any) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "s": "raw-session", "c": "", **fields})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_port_zero_reports_the_bound_port(server: TransferQueueServer) -> None:
    assert server.address.startswith("tcp://127.0.0.1:")
    assert int(server.address.rsplit(":", 1)[1]) > 0


def test_unreachable_server_error_says_what_to_check() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(TransferUnreachableError) as err:
        TransferQueueClient(address, secret=SECRET, connect_timeout=0.3)
    assert time.monotonic() - t0 < 3
    message = str(err.value)
    assert f"transfer queue at {address} did not answer within 0.3s" in message
    assert "is the driver running?" in message


def test_server_gone_mid_session_raises_after_retries(server: TransferQueueServer) -> None:
    client = TransferQueueClient(server.address, secret=SECRET, request_timeout=0.2, retries=1)
    server.stop()
    with pytest.raises(TransferUnreachableError, match=r"0.2s \(2 attempt"):
        client.partitions()
    client.close()


MALFORMED: list[tuple[str, list[bytes]]] = [
    ("not msgpack", [b"\xc1\xff\x00garbage"]),
    ("pickle is not accepted", [b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8c\x01x\x94."]),
    ("header not a map", [msgpack.packb([1, 2, 3])]),
    ("wrong version", [msgpack.packb({"v": 99, "op": "ping", "id": 1})]),
    ("unknown op", [head(op="explode", id=2)]),
    ("missing partition", [head(op="put", id=3, blocks=[], timeout=1.0)]),
    ("bool as int", [head(op="get", id=4, p="train_0", task="a", fields=[], n=True, timeout=1.0)]),
    ("dtype not allowed", [head(op="put", id=5, p="t", blocks=[{"n": 1, "cols": {"x": ["t", "object", [[1]], 0]}}], timeout=1.0), b"\x00" * 8]),
    ("frame index out of range", [head(op="put", id=6, p="t", blocks=[{"n": 1, "cols": {"x": ["t", "int64", [[1]], 3]}}], timeout=1.0), b"\x00" * 8]),
    ("byte count mismatch", [head(op="put", id=7, p="t", blocks=[{"n": 1, "cols": {"x": ["t", "float32", [[4]], 0]}}], timeout=1.0), b"\x00" * 8]),
    ("negative dim", [head(op="put", id=8, p="t", blocks=[{"n": 1, "cols": {"x": ["n", "float32", [[-1]], 0]}}], timeout=1.0), b""]),
    ("inline list", [head(op="put", id=9, p="t", blocks=[{"n": 1, "cols": {"x": ["v", [[1, 2]]]}}], timeout=1.0)]),
    ("blocks not a list", [head(op="write", id=10, p="t", idx=[0], blocks={"x": 1})]),
    ("block row count mismatch", [head(op="put", id=13, p="t", blocks=[{"n": 2, "cols": {"x": ["v", [1]]}}], timeout=1.0)]),
    ("bool as dim", [head(op="put", id=14, p="t", blocks=[{"n": 1, "cols": {"x": ["n", "uint8", [[True]], 0]}}], timeout=1.0), b"\x00"]),
    ("per-row frame too short", [head(op="put", id=15, p="t", blocks=[{"n": 2, "cols": {"x": ["n", "uint8", [[2], [2]], [0, 1]]}}], timeout=1.0), b"\x00\x00", b"\x00"]),
    ("get without session", [msgpack.packb({"v": WIRE_VERSION, "op": "get", "id": 11, "p": "t", "task": "a", "fields": [], "n": 1, "timeout": 1.0})]),
    ("negative timeout", [head(op="wait_start", id=12, step=5, max_staleness=0, timeout=-1.0)]),
    ("empty message", []),
]


@pytest.mark.parametrize("frames", [f for _, f in MALFORMED], ids=[name for name, _ in MALFORMED])
def test_malformed_messages_get_an_error_and_the_server_keeps_serving(
    server: TransferQueueServer, raw: zmq.Socket[Any], frames: list[bytes]
) -> None:
    client = TransferQueueClient(server.address, secret=SECRET, request_timeout=5.0)
    client.put("train_0", [{"x": torch.ones(2)}])
    if frames:
        reply, _ = exchange(raw, frames)
    else:  # a DEALER cannot send zero frames; an empty header frame is the closest thing
        reply, _ = exchange(raw, [b""])
    assert reply["ok"] is False and reply["kind"] == "invalid", reply
    assert "malformed request" in reply["error"]
    assert [p.rows for p in client.partitions()] == [1]  # nothing was added by the bad message
    assert client.get("train_0", "actor", ["x"], 1, timeout=1).indices == [0]
    client.close()


def test_retried_put_is_applied_once(server: TransferQueueServer, raw: zmq.Socket[Any]) -> None:
    data = np.arange(4, dtype=np.float32)
    put = [head(op="put", id=1, p="train_0", blocks=[{"n": 1, "cols": {"x": ["n", "float32", [[4]], 0]}}], timeout=1.0), data.tobytes()]
    first, _ = exchange(raw, put)
    again, _ = exchange(raw, put)  # as if the first reply was lost
    assert first == again and first["idx"] == [0]
    client = TransferQueueClient(server.address, secret=SECRET)
    assert [p.rows for p in client.partitions()] == [1]
    got = client.get("train_0", "actor", ["x"], 1, timeout=1).rows[0]["x"]
    np.testing.assert_array_equal(got, data)
    client.close()


def test_each_of_several_requests_in_flight_is_answered_once_on_retry(
    server: TransferQueueServer, raw: zmq.Socket[Any]
) -> None:
    def put(req_id: int, oldest: int, value: float) -> list[bytes]:
        blocks = [{"n": 1, "cols": {"x": ["v", [value]]}}]
        return [head(op="put", id=req_id, r=oldest, p="train_0", blocks=blocks, timeout=1.0)]

    first, second = put(1, 1, 1.0), put(2, 1, 2.0)
    raw.send_multipart(first)
    raw.send_multipart(second)  # two puts in flight, neither answered yet
    answers = {}
    for _ in range(2):
        assert raw.poll(5000)
        reply = msgpack.unpackb(raw.recv_multipart()[0])
        answers[reply["id"]] = reply["idx"]
    assert answers == {1: [0], 2: [1]}
    assert exchange(raw, first)[0]["idx"] == [0]  # both replies lost: each retry gets its answer
    assert exchange(raw, second)[0]["idx"] == [1]
    client = TransferQueueClient(server.address, secret=SECRET)
    assert [p.rows for p in client.partitions()] == [2]  # applied once each
    # once the client says it has every reply before id 3, a request 1 counts as new
    assert exchange(raw, put(3, 3, 3.0))[0]["idx"] == [2]
    assert exchange(raw, put(1, 3, 1.0))[0]["idx"] == [3]
    client.close()


def test_put_async_keeps_puts_in_flight_and_a_complete_waits_for_them(server: TransferQueueServer) -> None:
    producer = TransferQueueClient(server.address, secret=SECRET)
    pending = [producer.put_async("train_0", [{"x": torch.full((3,), float(i))}] * 2) for i in range(6)]
    producer.complete("train_0", 12)  # waits for the puts still in flight
    assert all(p.done for p in pending)
    assert sorted(i for p in pending for i in p.result()) == list(range(12))
    consumer = TransferQueueClient(server.address, secret=SECRET)
    batch = consumer.get("train_0", "actor", ["x"], 12, timeout=5)
    assert batch.end and [float(r["x"][0]) for r in batch.rows] == [i // 2 for i in range(12)]  # type: ignore[index]
    producer.close()
    consumer.close()


def test_close_waits_for_the_puts_still_in_flight(server: TransferQueueServer) -> None:
    producer = TransferQueueClient(server.address, secret=SECRET)
    actor = TransferQueueClient(server.address, secret=SECRET)
    full = producer.put_async("train_0", [{"x": 1}] * 100)  # capacity 100
    parked = producer.put_async("train_1", [{"x": 2}])  # waits on the server for room
    clearing = threading.Timer(0.3, lambda: actor.clear("train_0"))
    clearing.start()
    t0 = time.monotonic()
    producer.close()  # nobody asked for a result: close still waits for every reply
    assert time.monotonic() - t0 >= 0.25
    assert full.done and parked.done and parked.indices == [0]
    assert [p.rows for p in actor.partitions()] == [1]
    clearing.join()
    actor.close()


def test_a_refused_put_async_raises_at_its_result_or_at_the_next_call(server: TransferQueueServer) -> None:
    producer = TransferQueueClient(server.address, secret=SECRET)
    too_big = producer.put_async("train_0", [{"x": 1}] * 101)  # capacity 100
    fine = producer.put_async("train_0", [{"x": 1}])
    with pytest.raises(TransferQueueError, match="can never fit"):
        too_big.result()
    assert fine.result() == [0]
    unseen = producer.put_async("train_1", [{"x": 1}] * 101)
    with pytest.raises(TransferQueueError, match="can never fit"):
        producer.complete("train_1", 1)  # nobody looked at the refused put: the next call says so
    assert unseen.done
    producer.complete("train_1", 0)  # reported once; the client goes on
    producer.close()


def test_a_prefetched_reply_collected_after_its_deadline_is_still_taken(server: TransferQueueServer) -> None:
    producer = TransferQueueClient(server.address, secret=SECRET)
    producer.put("train_0", [{"x": float(i)} for i in range(4)])
    producer.complete("train_0", 4)
    # no retries and a short reply timeout: a slow caller must not turn a waiting reply into an error
    consumer = TransferQueueClient(server.address, secret=SECRET, request_timeout=0.2, retries=0)
    seen = []
    for batch in consumer.stream("train_0", "actor", ["x"], 2, timeout=0.1):
        seen.extend(batch.indices)
        time.sleep(0.5)  # the next get's reply arrived long ago
    assert seen == [0, 1, 2, 3]
    producer.close()
    consumer.close()


def test_a_stream_and_writes_share_one_client(server: TransferQueueServer) -> None:
    """A role's pattern: the next get waits on the server while the role writes its field."""
    producer = TransferQueueClient(server.address, secret=SECRET)
    role = TransferQueueClient(server.address, secret=SECRET)
    feeding = producer.put_async("train_0", [{"x": float(i)} for i in range(3)])
    written = []
    for batch in role.stream("train_0", "fwd", ["x"], 2, timeout=5):
        if batch.rows:
            role.write("train_0", batch.indices, [{"y": float(r["x"]) * 10} for r in batch.rows])  # type: ignore[arg-type]
            written.extend(batch.indices)
        if len(written) == 2:
            producer.put("train_0", [{"x": 3.0}])
            producer.complete("train_0", 4)
    assert feeding.result() == [0, 1, 2] and written == [0, 1, 2, 3]
    got = TransferQueueClient(server.address, secret=SECRET).get("train_0", "actor", ["y"], 4, timeout=5)
    assert [r["y"] for r in got.rows] == [0.0, 10.0, 20.0, 30.0]
    producer.close()
    role.close()


def test_error_reply_for_refused_request(server: TransferQueueServer) -> None:
    client = TransferQueueClient(server.address, secret=SECRET)
    with pytest.raises(TransferQueueError, match="can never fit in a queue of capacity 100"):
        client.put("train_0", [{"x": 1}] * 101)
    client.close()


def test_received_tensors_are_writable_and_independent(server: TransferQueueServer) -> None:
    client = TransferQueueClient(server.address, secret=SECRET)
    client.put("train_0", [{"x": torch.zeros(64 * 1024)}])
    a = client.get("train_0", "t1", ["x"], 1, timeout=1).rows[0]["x"]
    b = client.get("train_0", "t2", ["x"], 1, timeout=1).rows[0]["x"]
    a += 1  # a consumer may work in place on what it received
    assert torch.all(a == 1) and torch.all(b == 0)
    client.close()


def test_many_parked_gets_do_not_stall_other_clients(server: TransferQueueServer) -> None:
    waiters = [TransferQueueClient(server.address, secret=SECRET) for _ in range(3)]
    for i, w in enumerate(waiters):  # park three gets on the server, then talk to it
        w._sock.send_multipart(
            [head(s=f"waiter{i}", op="get", id=1, p="train_9", task=f"t{i}", fields=["x"], n=1, timeout=5.0)]
        )
    client = TransferQueueClient(server.address, secret=SECRET, request_timeout=1.0, retries=0)
    t0 = time.monotonic()
    assert client.partitions() == []
    assert time.monotonic() - t0 < 0.5
    client.put("train_9", [{"x": 7}])
    for w in waiters:
        assert w._sock.poll(2000)
        reply = msgpack.unpackb(w._sock.recv_multipart()[0])
        assert reply["ok"] and reply["idx"] == [0]
        w.close()
    client.close()


def test_prefetch_sends_the_get_before_the_stream_asks(server: TransferQueueServer) -> None:
    first = TransferQueueClient(server.address, secret=SECRET, consumer_id="first")
    other = TransferQueueClient(server.address, secret=SECRET, consumer_id="other")
    producer = TransferQueueClient(server.address, secret=SECRET)
    try:
        first.prefetch("train_0", "actor", ["x"], 4, timeout=5)
        producer.put("train_0", [{"x": torch.tensor([float(i)])} for i in range(4)])
        time.sleep(0.3)  # the server answered the prefetched get: those 4 rows are first's now
        with pytest.raises(TransferTimeoutError):  # nothing left for another consumer
            other.get("train_0", "actor", ["x"], 4, timeout=0.3)
        producer.complete("train_0", 4)
        batches = list(first.stream("train_0", "actor", ["x"], 4, timeout=5))
        assert batches[0].indices == [0, 1, 2, 3]
    finally:
        for c in (first, other, producer):
            c.close()
