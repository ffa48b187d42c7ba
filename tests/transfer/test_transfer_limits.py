"""Bounded inputs of the ZMQ queue server, against the real server over real sockets: hostile
headers are refused before they cost memory, oversized frames drop the connection, parked
requests of vanished clients are dropped, and the server serves normal clients after each."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from relax_hpc.auth import JobSecret
from relax_hpc.transfer import TransferQueueError
from relax_hpc.transfer.curve import queue_keys, set_client_keys
from relax_hpc.transfer.limits import MAX_REQUEST_ROWS, MAX_REQUEST_VALUES
from relax_hpc.transfer.queue import Batch
from relax_hpc.transfer.wire import MAX_FIELDS, WIRE_VERSION
from relax_hpc.transfer.zmq_client import TransferQueueClient
from relax_hpc.transfer.zmq_server import TransferQueueServer

MiB = 1 << 20
SECRET = JobSecret.generate()  # the servers' job secret; clients and raw sockets use its keys


@pytest.fixture
def server() -> Iterator[TransferQueueServer]:
    srv = TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, capacity=100, shm=False, max_header_bytes=64 * 1024)
    srv.start()
    yield srv
    srv.stop()


def dealer(address: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    set_client_keys(sock, queue_keys(SECRET))
    sock.connect(address)
    return sock


def ask(sock: zmq.Socket[Any], frames: list[Any]) -> dict[str, Any]:
    sock.send_multipart(frames, copy=False)
    assert sock.poll(30_000), "the server did not answer"
    return msgpack.unpackb(sock.recv_multipart()[0])


def head(**fields: Any) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "s": "raw-session", "c": "", **fields})


def assert_serves(address: str) -> None:
    """A normal client can still put and get."""
    client = TransferQueueClient(address, secret=SECRET, shm=False, request_timeout=10.0)
    try:
        client.put("healthy", [{"x": torch.arange(3)}])
        got = client.get("healthy", f"check-{time.monotonic_ns()}", ["x"], 1, timeout=10).rows[0]["x"]
        assert torch.equal(got, torch.arange(3))  # type: ignore[arg-type]
        client.clear("healthy")
    finally:
        client.close()


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def peak_rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    """Set this process's peak RSS back to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError as exc:
        pytest.skip(f"cannot reset the peak RSS here: {exc}")


@pytest.mark.parametrize("capacity", [100, None], ids=["capacity", "unbounded"])
def test_amplification_header_is_refused_before_any_row_is_built(capacity: int | None) -> None:
    # Two blocks of 2**24 field-less rows: 55 bytes that used to cost the server gigabytes.
    header = msgpack.packb({"v": WIRE_VERSION, "id": 1, "op": "put", "p": "t",
                            "blocks": [{"n": 1 << 24, "cols": {}}] * 2})
    assert len(header) < 62
    with TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, capacity=capacity, shm=False) as srv:
        raw = dealer(srv.address)
        ask(raw, [head(op="ping", id=0)])  # connected, everything imported
        reset_peak_rss()
        before = peak_rss_mb()
        reply = ask(raw, [header])
        grown = peak_rss_mb() - before  # the server runs in this process, on a thread
        raw.close(0)
        assert reply["ok"] is False and reply["kind"] == "refused", reply
        limit = capacity or MAX_REQUEST_ROWS
        assert f"{2 << 24} rows" in reply["error"] and str(limit) in reply["error"], reply["error"]
        assert grown < 50, f"peak RSS grew by {grown:.0f} MB"
        assert_serves(srv.address)


def cols(n: int) -> dict[str, Any]:
    return {f"f{i}": ["v", [0]] for i in range(n)}


HOSTILE: list[tuple[str, list[bytes], str, str]] = [
    ("huge shape, 8-byte payload",
     [head(op="put", id=1, p="t", timeout=0, blocks=[{"n": 1, "cols": {"x": ["t", "float32", [[1 << 40, 1 << 20]], 0]}}]), b"\x00" * 8],
     "invalid", "need 4611686018427387904 bytes, frame 0 has 8"),
    ("rows claimed beyond a column's values",
     [head(op="put", id=2, p="t", timeout=0, blocks=[{"n": 90, "cols": {"x": ["v", [1]]}}])],
     "invalid", "inline column must be ['v', [90 values]]"),
    ("more rows than the capacity",
     [head(op="put", id=3, p="t", timeout=0, blocks=[{"n": 101, "cols": {"x": ["v", [1] * 101]}}])],
     "refused", "can never fit in a queue of capacity 100"),
    ("one frame named for two rows",
     [head(op="put", id=4, p="t", timeout=0, blocks=[{"n": 2, "cols": {"x": ["n", "uint8", [[4], [4]], [0, 0]]}}]), b"\x00" * 4],
     "invalid", "frame 0 is named twice"),
    ("one frame named by two columns",
     [head(op="put", id=5, p="t", timeout=0, blocks=[{"n": 1, "cols": {"x": ["n", "uint8", [[4]], 0], "y": ["n", "uint8", [[4]], 0]}}]), b"\x00" * 4],
     "invalid", "frame 0 is named twice"),
    ("too many fields",
     [head(op="put", id=6, p="t", timeout=0, blocks=[{"n": 1, "cols": cols(MAX_FIELDS + 1)}])],
     "invalid", f"at most {MAX_FIELDS} fields"),
    ("write claiming millions of rows",
     [head(op="write", id=7, p="t", idx=[0], blocks=[{"n": 1 << 24, "cols": {}}])],
     "refused", "request of 16777216 rows exceeds this queue's limit of 100 rows"),
    ("write rows and indices differ",
     [head(op="write", id=10, p="t", idx=[0, 1], blocks=[{"n": 1, "cols": {"x": ["v", [1]]}}])],
     "refused", "2 indices but 1 rows"),
    ("header over the server's limit",
     [head(op="ping", id=8, pad="x" * (64 * 1024))],
     "invalid", "exceeds the limit of 65536"),
    ("session id too long",
     [msgpack.packb({"v": WIRE_VERSION, "id": 9, "s": "s" * 1000, "op": "ping"})],
     "invalid", "session id of 1000 characters"),
]


@pytest.mark.parametrize(("frames", "kind", "message"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_requests_are_refused_and_the_server_keeps_serving(
    server: TransferQueueServer, frames: list[bytes], kind: str, message: str
) -> None:
    raw = dealer(server.address)
    reply = ask(raw, frames)
    raw.close(0)
    assert reply["ok"] is False and reply["kind"] == kind, reply
    assert message in reply["error"], reply["error"]
    assert_serves(server.address)
    probe = TransferQueueClient(server.address, secret=SECRET, shm=False)
    assert probe.partitions() == []  # nothing of the refused requests was stored
    probe.close()


def test_too_many_values_are_refused_from_the_header_alone() -> None:
    rows = MAX_REQUEST_ROWS
    fields = MAX_REQUEST_VALUES // rows + 1
    # The columns are junk: the count is refused before any of them is read.
    blocks = [{"n": rows, "cols": {f"f{i}": 0 for i in range(fields)}}]
    with TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, shm=False) as srv:
        raw = dealer(srv.address)
        reply = ask(raw, [head(op="put", id=1, p="t", timeout=0, blocks=blocks)])
        raw.close(0)
        assert reply["kind"] == "refused" and f"limit of {MAX_REQUEST_VALUES}" in reply["error"], reply
        assert_serves(srv.address)


def test_an_error_reply_does_not_echo_a_huge_request(server: TransferQueueServer) -> None:
    raw = dealer(server.address)
    reply = ask(raw, [head(op="x" * 50_000, id=1)])
    raw.close(0)
    assert reply["kind"] == "invalid" and "unknown op" in reply["error"]
    assert len(reply["error"]) < 2100


def test_a_frame_over_the_limit_drops_the_connection_and_the_server_keeps_serving() -> None:
    with TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, shm=False) as srv:  # default limit: 256 MiB
        raw = dealer(srv.address)
        monitor = raw.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        ask(raw, [head(op="ping", id=0)])
        # calloc'd zero pages: sending reads them without making them resident
        big = np.zeros(512 * MiB, dtype=np.uint8)
        blocks = [{"n": 1, "cols": {"x": ["n", "uint8", [[512 * MiB]], 0]}}]
        raw.send_multipart([head(op="put", id=1, p="big", timeout=0, blocks=blocks), big.data], copy=False)
        assert monitor.poll(60_000), "the server kept the connection of a 512 MiB frame"
        assert parse_monitor_message(monitor.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED
        raw.disable_monitor()
        monitor.close(0)
        raw.close(0)
        del big
        assert_serves(srv.address)
        client = TransferQueueClient(srv.address, secret=SECRET, shm=False)
        assert client.partitions() == []  # the put never reached the queue
        client.close()


def test_clients_keep_their_frames_within_the_servers_limit() -> None:
    with TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, shm=False, max_frame_bytes=MiB) as srv:
        client = TransferQueueClient(srv.address, secret=SECRET, shm=False)
        # 64 rows of 32 KiB would be joined into one 2 MiB frame: they go one frame per row
        rows = [{"x": torch.full((8192,), float(i))} for i in range(64)]
        assert client.put("train_0", rows) == list(range(64))
        got = client.get("train_0", "actor", ["x"], 64, timeout=10)
        assert [float(r["x"][0]) for r in got.rows] == [float(i) for i in range(64)]  # type: ignore[index]
        with pytest.raises(TransferQueueError, match=r"2097152 bytes exceeds the queue server's frame limit of 1048576"):
            client.put("train_1", [{"x": torch.zeros(2 * MiB, dtype=torch.uint8)}])
        with pytest.raises(TransferQueueError, match="request header of .* exceeds the limit"):
            client.put("train_1", [{"s": "y" * 60_000}] * 20)  # 1.2 MB of inline strings, 1 MiB allowed
        assert client.partitions()[0].rows == 64  # the client goes on
        client.close()


@pytest.fixture
def quick() -> Iterator[TransferQueueServer]:
    """A server that looks for vanished clients every 0.1 s."""
    srv = TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, capacity=1, shm=False, heartbeat_s=0.1)
    srv.start()
    yield srv
    srv.stop()


def parked(srv: TransferQueueServer) -> int:
    return len(srv._parked)


def test_a_parked_get_of_a_vanished_client_is_dropped(quick: TransferQueueServer) -> None:
    get = head(s="gone", c="gone", op="get", id=1, p="train_0", task="actor", fields=["x"], n=1, timeout=600.0)
    first = dealer(quick.address)
    first.send_multipart([get])
    wait_for(lambda: parked(quick) == 1, "the get to be parked")
    first.close(0)  # the client's process died: its connection closes
    wait_for(lambda: parked(quick) == 0, "the vanished client's get to be dropped")
    # Forgotten entirely: the same request resent over a new connection waits again ...
    second = dealer(quick.address)
    second.send_multipart([get])
    wait_for(lambda: parked(quick) == 1, "the resent get to be parked")
    producer = TransferQueueClient(quick.address, secret=SECRET, shm=False)
    producer.put("train_0", [{"x": 1}])
    # ... and is answered, over the live connection
    assert second.poll(30_000)
    reply = msgpack.unpackb(second.recv_multipart()[0])
    assert reply["ok"] and reply["idx"] == [0], reply
    second.close(0)
    producer.close()


def test_a_parked_put_of_a_vanished_client_is_never_applied(quick: TransferQueueServer) -> None:
    producer = TransferQueueClient(quick.address, secret=SECRET, shm=False)
    producer.put("train_0", [{"x": 0}])  # capacity 1: the queue is full
    raw = dealer(quick.address)
    blocks = [{"n": 1, "cols": {"x": ["n", "float32", [[MiB // 4]], 0]}}]
    raw.send_multipart([head(op="put", id=1, p="train_1", timeout=600.0, blocks=blocks), bytes(MiB)])
    wait_for(lambda: parked(quick) == 1, "the put to be parked")
    raw.close(0)
    wait_for(lambda: parked(quick) == 0, "the vanished client's put to be dropped")
    producer.clear("train_0")  # room again: a put still parked would be applied now
    assert producer.partitions() == []
    producer.close()


def test_a_live_client_keeps_its_parked_get_through_the_probes(quick: TransferQueueServer) -> None:
    consumer = TransferQueueClient(quick.address, secret=SECRET, shm=False)
    got: list[Batch] = []
    waiting = threading.Thread(target=lambda: got.append(consumer.get("train_0", "actor", ["x"], 1, timeout=60)))
    waiting.start()
    wait_for(lambda: parked(quick) == 1, "the get to be parked")
    time.sleep(0.5)  # several probes reach the waiting client, which ignores them
    assert parked(quick) == 1
    producer = TransferQueueClient(quick.address, secret=SECRET, shm=False)
    producer.put("train_0", [{"x": 7}])
    waiting.join(30)
    assert [b.rows for b in got] == [[{"x": 7}]]
    consumer.close()
    producer.close()
