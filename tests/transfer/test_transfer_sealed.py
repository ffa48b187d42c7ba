"""Sealed sessions against the real server (payload = "encrypt" / "authenticate"): a TCP client
moves to the data socket with the key its CURVE ping reply carried, and nothing else that
reaches the data socket is answered or applied: not a plain request, not garbage, not a
recorded message replayed, not one session's key carrying another session's request. The
whole queue contract over sealed sessions is tests/transfer/test_transfer_queue_contract.py's
("zmq-encrypt", "zmq-authenticate")."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import zmq

from relax_hpc.auth import JobSecret
from relax_hpc.transfer.curve import TransferAuthError
from relax_hpc.transfer.sealed_socket import SealedDealer
from relax_hpc.transfer.wire import WIRE_VERSION, pack_header, unpack_header
from relax_hpc.transfer.zmq_client import TransferQueueClient
from relax_hpc.transfer.zmq_server import TransferQueueServer

SECRET = JobSecret.generate()


@pytest.fixture(params=["encrypt", "authenticate"])
def server(request: pytest.FixtureRequest) -> Iterator[TransferQueueServer]:
    srv = TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, capacity=100, shm=True,
                              heartbeat_s=0.1, payload=request.param)
    srv.start()
    yield srv
    srv.stop()


def tcp_client(server: TransferQueueServer, consumer_id: str = "") -> TransferQueueClient:
    return TransferQueueClient(server.address, secret=SECRET, consumer_id=consumer_id, shm=False,
                               connect_timeout=5.0, request_timeout=5.0)


def plain_dealer(endpoint: str) -> zmq.Socket[Any]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def rows(n: int) -> list[dict[str, Any]]:
    return [{"x": torch.full((4096,), float(i))} for i in range(n)]


def wait_for(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_tcp_client_moves_to_the_data_socket_and_a_same_host_one_stays_on_shm(
        server: TransferQueueServer) -> None:
    mode = server._session_keys.mode  # type: ignore[union-attr]
    with tcp_client(server) as remote, TransferQueueClient(server.address, secret=SECRET) as local:
        assert remote.payload == mode and remote.endpoint != server.address
        assert remote.endpoint.rsplit(":", 1)[0] == server.address.rsplit(":", 1)[0]  # the host it reached
        assert local.payload == "curve" and local.shm_dir is not None  # references only: nothing to seal
        remote.put("p", rows(3))
        batch = local.get("p", "actor", ["x"], 3, timeout=10)
        assert [float(r["x"][0]) for r in batch.rows] == [0.0, 1.0, 2.0]


def test_a_client_without_the_job_secret_is_still_refused_at_the_handshake(server: TransferQueueServer) -> None:
    with pytest.raises(TransferAuthError):
        TransferQueueClient(server.address, secret=JobSecret.generate(), shm=False, connect_timeout=5.0)


def test_a_recorded_put_replayed_on_the_data_socket_adds_no_row(server: TransferQueueServer) -> None:
    producer = tcp_client(server)
    assert isinstance(producer._sock, SealedDealer)
    sent: list[list[Any]] = []
    inner = producer._sock._sock
    send = inner.send_multipart

    def record(frames: list[Any], copy: bool = False) -> None:
        sent.append([bytes(memoryview(f)) for f in frames])
        send(frames, copy=copy)

    inner.send_multipart = record  # type: ignore[method-assign]
    producer.put("p", rows(2))
    producer.close()
    assert sent, "the put went out on the data socket"
    attacker = plain_dealer(f"{server.address.rsplit(':', 1)[0]}:{server._data_port}")
    for message in sent:
        attacker.send_multipart(message)
    with tcp_client(server, "checker") as check:
        wait_for(lambda: server._unopened >= len(sent), "the replayed messages to be dropped")
        assert [(p.name, p.rows) for p in check.partitions()] == [("p", 2)]  # not 4
    assert attacker.poll(300) == 0  # and never answered
    attacker.close(0)


def test_plain_requests_and_garbage_on_the_data_socket_are_dropped_and_change_nothing(
        server: TransferQueueServer) -> None:
    with tcp_client(server) as client:
        client.put("p", rows(2))
        attacker = plain_dealer(client.endpoint)
        clear = pack_header({"v": WIRE_VERSION, "id": 1, "s": "x" * 32, "c": "", "op": "clear", "p": "p"})
        attacker.send_multipart([clear])
        attacker.send_multipart([b"RTQ1" + bytes(29), clear])  # a prefix naming a key nobody was given
        attacker.send_multipart([b"garbage", b"\x00" * 1000])
        wait_for(lambda: server._unopened >= 3, "the three messages to be dropped")
        assert attacker.poll(300) == 0
        attacker.close(0)
        assert [(p.name, p.rows) for p in client.partitions()] == [("p", 2)]  # still served, nothing cleared


def test_one_sessions_key_carries_no_request_of_another_session(server: TransferQueueServer) -> None:
    with tcp_client(server, "a") as a, tcp_client(server, "b") as b:
        b.put("p", rows(1))
        assert isinstance(a._sock, SealedDealer)
        sealer = a._sock._sealer
        raw = plain_dealer(a.endpoint)
        forged = pack_header({"v": WIRE_VERSION, "id": 1, "s": b.session, "c": "b", "op": "clear", "p": "p"})
        raw.send_multipart(sealer.seal([forged]))
        assert raw.poll(10_000), "the server answers the key's holder"
        reply = unpack_header(sealer.open(raw.recv_multipart())[0])
        assert reply["ok"] is False and reply["kind"] == "invalid", reply
        assert "only that session's requests" in reply["error"]
        raw.close(0)
        assert [(p.name, p.rows) for p in b.partitions()] == [("p", 1)]
        assert [(p.name, p.rows) for p in a.partitions()] == [("p", 1)]  # a's own session goes on


def test_a_parked_get_of_a_vanished_sealed_client_is_dropped(server: TransferQueueServer) -> None:
    consumer = tcp_client(server)
    consumer._pipe.send({"op": "get", "p": "q", "task": "actor", "fields": ["x"], "n": 1, "timeout": 600.0},
                        (), 600.0, 5.0, 0)
    wait_for(lambda: len(server._parked) == 1, "the get to be parked")
    consumer._sock.close(0)  # the process died: its connection closes
    wait_for(lambda: not server._parked, "the vanished client's get to be dropped")
    with tcp_client(server) as live:  # a live sealed client keeps its parked get through the probes
        with tcp_client(server) as producer:
            got: list[int] = []
            pending = live._send_get("q", "actor", ["x"], 1, 30.0, ())
            wait_for(lambda: len(server._parked) == 1, "the live get to be parked")
            time.sleep(0.5)  # several probe rounds, unsealed: the client drops them unread
            producer.put("q", rows(1))
            with live._lock:
                reply, _ = live._pipe.collect(pending)
            got = reply["idx"]
            assert got == [0]
