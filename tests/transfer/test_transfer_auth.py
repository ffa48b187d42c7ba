"""Authentication of the ZMQ queue against the real server: only holders of the job secret get
an answer, on the tcp and the same-host ipc:// endpoint, and a session keeps its consumer id."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from relax_hpc.auth import JobSecret, write_job_secret
from relax_hpc.transfer import TransferUnreachableError, shm
from relax_hpc.transfer.connect import connect_queue
from relax_hpc.transfer.curve import TransferAuthError, queue_keys, set_client_keys
from relax_hpc.transfer.sessions import ConsumerMismatchError, SessionConsumers
from relax_hpc.transfer.wire import WIRE_VERSION, WireError, pack_header, unpack_header
from relax_hpc.transfer.zmq_client import TransferQueueClient
from relax_hpc.transfer.zmq_requests import RequestPipe
from relax_hpc.transfer.zmq_server import TransferQueueServer

SECRET = JobSecret.generate()
ROWS = 4
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@pytest.fixture
def server() -> Iterator[TransferQueueServer]:
    """A queue with ``train_0`` holding ROWS rows, listening on tcp and on its ipc:// socket."""
    srv = TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, capacity=100, shm=True)
    srv.start()
    assert srv.shm_dir is not None, "these tests need the same-host endpoint (is /dev/shm mounted?)"
    producer = TransferQueueClient(srv.address, secret=SECRET)
    producer.put("train_0", [{"x": torch.full((2,), float(i))} for i in range(ROWS)])
    producer.complete("train_0", ROWS)
    producer.close()
    yield srv
    srv.stop()


def ipc_endpoint(server: TransferQueueServer) -> str:
    assert server.shm_dir is not None
    return f"ipc://{os.path.join(server.shm_dir, shm.SOCKET_FILE)}"


def untouched(server: TransferQueueServer) -> None:
    """``train_0`` still holds every row, and none was handed out for task 'actor'."""
    with TransferQueueClient(server.address, secret=SECRET, consumer_id="checker") as check:
        assert [(p.name, p.rows, p.complete) for p in check.partitions()] == [("train_0", ROWS, True)]
        batch = check.get("train_0", "actor", ["x"], ROWS, timeout=5)
        assert batch.indices == list(range(ROWS)) and batch.end


def raw_dealer(endpoint: str, client_keys: tuple[bytes, bytes] | None) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    """A DEALER (with a CURVE key pair of its own and the server's real public key, or without
    CURVE) connected to ``endpoint``, and a monitor of its handshake."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A send with no peer raises zmq.Again after this instead of hanging the test. It finds a peer
    # at once unless the refusal came first (then it never will, and the test waited it out).
    sock.setsockopt(zmq.SNDTIMEO, 3_000)
    if client_keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, queue_keys(SECRET).server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, client_keys[0])
        sock.setsockopt(zmq.CURVE_SECRETKEY, client_keys[1])
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
    sock.connect(endpoint)
    return sock, monitor


@pytest.mark.parametrize("endpoint", ["tcp", "ipc"])
@pytest.mark.parametrize("client_keys", [None, zmq.curve_keypair()], ids=["no-curve", "own-key-pair"])
def test_a_clear_from_outside_the_job_is_never_answered_and_clears_nothing(
    server: TransferQueueServer, endpoint: str, client_keys: tuple[bytes, bytes] | None
) -> None:
    # no-curve: the handshake fails on the mechanism. own-key-pair: the peer even knows the
    # server's public key, and the ZAP handler refuses its key. (Which failure event the peer
    # sees depends on whether the server's error or its close arrives first.)
    address = server.address if endpoint == "tcp" else ipc_endpoint(server)
    sock, monitor = raw_dealer(address, client_keys)
    try:
        # Queued at once, before the handshake ends (after a refusal the socket has no peer left:
        # when the refusal comes first, as it can over ipc, the send finds no peer and times out,
        # and nothing was sent at all).
        pipe = RequestPipe(sock, address, "intruder-session", "actor")  # the client's own wire code
        try:
            req_id: int | None = pipe.send({"op": "clear", "p": "train_0"}, (), wait=0.0, timeout=1.0, retries=0)
        except zmq.Again:
            req_id = None
        assert monitor.poll(30_000), "no handshake event"
        event = parse_monitor_message(monitor.recv_multipart())
        assert event["event"] & HANDSHAKE_FAILED, event
        if req_id is not None:
            with pytest.raises(TransferUnreachableError):
                pipe.collect(req_id)
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
    untouched(server)


def test_a_client_with_another_jobs_secret_is_refused_and_takes_no_rows(server: TransferQueueServer) -> None:
    worker = TransferQueueClient(server.address, secret=SECRET, consumer_id="actor-rank0")
    held = worker.get("train_0", "actor", ["x"], 2, timeout=5)
    with pytest.raises(TransferAuthError) as err:  # a "restart" of actor-rank0 from outside the job
        TransferQueueClient(server.address, secret=JobSecret.generate(), consumer_id="actor-rank0")
    message = str(err.value)
    assert f"transfer queue at {server.address} refused this client's credentials" in message
    assert "RELAX_HPC_SECRET_FILE" in message and "job's secret" in message
    # The rows stay with the live session: it acks them (it was not fenced off) and reads on.
    assert worker.ack("train_0", "actor", held.indices) == 2
    rest = worker.get("train_0", "actor", ["x"], 2, timeout=5)
    assert rest.indices == [2, 3] and rest.end
    assert [(p.name, p.rows) for p in worker.partitions()] == [("train_0", ROWS)]
    worker.close()


def test_a_server_without_curve_is_named_as_such() -> None:
    plain: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
    plain.setsockopt(zmq.LINGER, 0)
    port = plain.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(TransferAuthError, match="does not use CURVE"):
            TransferQueueClient(f"tcp://127.0.0.1:{port}", secret=SECRET)
    finally:
        plain.close(0)


@pytest.mark.parametrize("path", ["tcp", "same-host"])
def test_the_jobs_secret_works_over_tcp_and_the_same_host_socket(server: TransferQueueServer, path: str) -> None:
    client = TransferQueueClient(server.address, secret=SECRET, shm=path == "same-host")
    assert client.endpoint == (server.address if path == "tcp" else ipc_endpoint(server))
    client.put("train_1", [{"x": torch.arange(3)}])
    got = client.get("train_1", "actor", ["x"], 1, timeout=5).rows[0]["x"]
    assert torch.equal(got, torch.arange(3))  # type: ignore[arg-type]
    assert client.clear("train_0") == ROWS
    client.close()


def test_connect_queue_uses_the_secret_file_of_the_environment(
    server: TransferQueueServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAX_HPC_SECRET_FILE", str(write_job_secret(tmp_path / "job", SECRET)))
    queue = connect_queue(server.address, "reader")
    assert queue.get("train_0", "reader", ["x"], ROWS, timeout=5).end
    queue.close()
    monkeypatch.setenv("RELAX_HPC_SECRET_FILE", str(write_job_secret(tmp_path / "other", JobSecret.generate())))
    with pytest.raises(TransferAuthError, match=str(tmp_path / "other")):
        connect_queue(server.address, "reader")


def test_a_session_keeps_the_consumer_id_of_its_first_request(server: TransferQueueServer) -> None:
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    set_client_keys(sock, queue_keys(SECRET))  # a member of the job, speaking the wire format itself
    sock.connect(server.address)

    def ask(**fields: Any) -> dict[str, Any]:
        sock.send_multipart([pack_header({"v": WIRE_VERSION, "s": "session-1", "r": 1, **fields})])
        assert sock.poll(30_000), "the server did not answer"
        return unpack_header(sock.recv_multipart()[0])

    get = {"op": "get", "p": "train_0", "task": "actor", "fields": ["x"], "n": 2, "timeout": 5.0}
    first = ask(id=1, c="actor-rank0", **get)
    assert first["ok"] and first["idx"] == [0, 1]
    other = ask(id=1, c="actor-rank1", **get)  # the same session and request id, another consumer
    assert other["ok"] is False and other["kind"] == "refused", other
    assert "speaks for consumer 'actor-rank0'" in other["error"] and "consumer_id='actor-rank1'" in other["error"]
    assert ask(id=2, c="actor-rank1", op="partitions")["ok"] is False  # any op, not only get and ack
    again = ask(id=1, c="actor-rank0", **get)  # a retry of request 1: its cached reply, no new rows
    assert again["ok"] and again["idx"] == [0, 1], again
    # A restart stays possible: a new session of actor-rank0 takes over its unacked rows ...
    restarted = TransferQueueClient(server.address, secret=SECRET, consumer_id="actor-rank0")
    assert restarted.get("train_0", "actor", ["x"], ROWS, timeout=5).indices == [0, 1, 2, 3]
    # ... and the old session is fenced off.
    fenced = ask(id=3, c="actor-rank0", op="ack", p="train_0", task="actor", idx=[0, 1])
    assert fenced["ok"] is False and "replaced by a newer one" in fenced["error"]
    restarted.close()
    sock.close(0)


def test_the_session_table_forgets_the_least_recently_used_session_first() -> None:
    table = SessionConsumers(max_sessions=2)
    table.bind("a", {"c": "x"})
    table.bind("b", {"c": "y"})
    table.bind("a", {"c": "x"})  # a is in use: b is now the least recently used
    table.bind("c", {})  # no 'c': the default consumer id ""
    with pytest.raises(ConsumerMismatchError):
        table.bind("a", {"c": "other"})
    assert table.bind("b", {"c": "new"}) == "new"  # forgotten: bound afresh, as a new session would be
    with pytest.raises(WireError, match="consumer id"):
        table.bind("d", {"c": 5})
