"""Same-host shared-memory path: reference validation, file cleanup, TCP fallback, restarts."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq

from relax_hpc.auth import JobSecret
from relax_hpc.transfer import TransferQueueError, shm
from relax_hpc.transfer.curve import queue_keys, set_client_keys
from relax_hpc.transfer.wire import WIRE_VERSION, WireError
from relax_hpc.transfer.zmq_client import TransferQueueClient
from relax_hpc.transfer.zmq_server import TransferQueueServer

SAMPLE = 64 * 1024 // 4  # float32 elements in a 64 KiB sample
SECRET = JobSecret.generate()  # the servers' job secret; clients and raw sockets use its keys


@pytest.fixture
def server() -> Iterator[TransferQueueServer]:
    srv = TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, capacity=1000, shm=True)
    srv.start()
    yield srv
    srv.stop()


def client(server: TransferQueueServer, **kwargs: Any) -> TransferQueueClient:
    return TransferQueueClient(server.address, secret=SECRET, request_timeout=5.0, **kwargs)


def payload_files(server: TransferQueueServer) -> list[str]:
    """Files a reference can name (released segments and temporaries start with '.')."""
    assert server.shm_dir is not None
    return sorted(f for f in os.listdir(server.shm_dir) if not f.startswith("."))


def all_files(server: TransferQueueServer) -> list[str]:
    """Every file but the server's owner file and socket."""
    assert server.shm_dir is not None
    return sorted(f for f in os.listdir(server.shm_dir) if f not in (shm.OWNER_FILE, shm.SOCKET_FILE))


def samples(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"x": torch.full((SAMPLE,), float(start + i)), "uid": start + i} for i in range(n)]


def one_sample_reply(name: str) -> list[dict[str, Any]]:
    """A get reply's blocks naming one 64 KiB float32 sample at offset 0 of payload `name`."""
    return [{"n": 1, "cols": {"x": ["s", "t", "float32", [[SAMPLE]], name, [0]]}}]


def raw_put(server: TransferQueueServer, partition: str, desc: list[Any], req_id: int = 1) -> dict[str, Any]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    set_client_keys(sock, queue_keys(SECRET))
    sock.connect(server.address)
    head = {"v": WIRE_VERSION, "s": f"raw-{req_id}", "c": "", "id": req_id, "op": "put", "p": partition,
            "blocks": [{"n": 1, "cols": {"x": desc}}], "timeout": 1.0}
    sock.send_multipart([msgpack.packb(head)])
    assert sock.poll(5000), "server did not answer"
    reply: dict[str, Any] = msgpack.unpackb(sock.recv_multipart()[0])
    sock.close(0)
    return reply


def test_same_host_client_uses_shm_and_server_never_holds_the_bytes(server: TransferQueueServer) -> None:
    producer, consumer = client(server), client(server)
    assert producer.shm_dir == server.shm_dir and consumer.shm_dir is not None
    producer.put("train_0", samples(4))
    assert len(payload_files(server)) == 1  # one payload file per put
    batch = consumer.get("train_0", "actor", ["x", "uid"], 4, timeout=5)
    assert [int(r["uid"]) for r in batch.rows] == [0, 1, 2, 3]
    for i, row in enumerate(batch.rows):
        assert torch.equal(row["x"], torch.full((SAMPLE,), float(i)))  # type: ignore[arg-type]
    producer.close()
    consumer.close()


def test_clear_releases_the_partition_files_and_received_tensors_stay_valid(server: TransferQueueServer) -> None:
    q = client(server)
    q.put("train_0", samples(2))
    q.put("train_1", samples(2, start=2))
    q.write("train_0", [0, 1], [{"log_probs": torch.ones(SAMPLE)}, {"log_probs": torch.zeros(SAMPLE)}])
    assert len(payload_files(server)) == 3
    batch = q.get("train_0", "actor", ["x", "log_probs"], 2, timeout=5)
    assert q.clear("train_0") == 2
    assert len(payload_files(server)) == 1  # train_1's file stays
    # what the consumer received owns its memory: still readable after the files are gone
    assert torch.equal(batch.rows[0]["log_probs"], torch.ones(SAMPLE))  # type: ignore[arg-type]
    assert torch.equal(batch.rows[1]["x"], torch.full((SAMPLE,), 1.0))  # type: ignore[arg-type]
    q.close()


def test_stop_removes_the_directory() -> None:
    srv = TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, shm=True)
    srv.start()
    directory = srv.shm_dir
    assert directory is not None and directory.startswith("/dev/shm/relax-tq-")
    q = TransferQueueClient(srv.address, secret=SECRET)
    q.put("train_0", samples(2))
    q.close()
    srv.stop()
    assert not os.path.exists(directory)


def test_refused_put_leaves_no_referenceable_file(server: TransferQueueServer) -> None:
    q = client(server)
    q.put("train_0", samples(1))
    q.clear("train_0")
    with pytest.raises(TransferQueueError, match="was cleared"):
        q.put("train_0", samples(2))
    assert payload_files(server) == []
    q.close()


def test_orphans_are_swept_but_fresh_and_owned_files_stay(server: TransferQueueServer, monkeypatch: Any) -> None:
    q = client(server)
    q.put("train_0", samples(1))
    q.put("train_1", samples(1))
    owned = payload_files(server)
    assert server.shm_dir is not None
    monkeypatch.setattr(shm, "ORPHAN_GRACE_S", 0.3)
    with open(os.path.join(server.shm_dir, "orphan-old"), "wb") as f:
        f.write(b"x" * 10)
    time.sleep(0.5)  # older than the grace period (a rename, utime etc. would renew ctime)
    with open(os.path.join(server.shm_dir, ".crashed.tmp"), "wb") as f:
        f.write(b"x" * 10)
    monkeypatch.setattr(shm, "SWEEP_INTERVAL_S", 0.0)  # sweep on this clear
    q.clear("train_0")
    left = all_files(server)
    assert "orphan-old" not in left  # old and nobody references it
    assert shm.OWNER_FILE in os.listdir(server.shm_dir or "")  # as old, but the server's own
    assert shm.SOCKET_FILE in os.listdir(server.shm_dir or "")  # so is its same-host endpoint
    assert ".crashed.tmp" in left  # may be a put still on its way: kept until it is old
    assert ".free-" + owned[0] in left or ".free-" + owned[1] in left  # train_0's, released just now
    assert set(payload_files(server)) < set(owned)  # train_1's file is owned: kept
    q.close()


BAD_REFS: list[tuple[str, list[Any], str]] = [
    ("parent dir", ["s", "t", "float32", [[2]], "..", [0]], "plain name"),
    ("slash", ["s", "t", "float32", [[2]], "a/b", [0]], "plain name"),
    ("absolute", ["s", "t", "float32", [[2]], "/etc/passwd", [0]], "plain name"),
    ("dot file", ["s", "t", "float32", [[2]], ".hidden", [0]], "plain name"),
    ("empty name", ["s", "t", "float32", [[2]], "", [0]], "plain name"),
    ("missing file", ["s", "t", "float32", [[2]], "nosuchfile", [0]], "does not exist"),
    ("negative offset", ["s", "t", "float32", [[2]], "data", [-1]], "offset"),
    ("past the end", ["s", "t", "float32", [[4]], "data", [4]], "holds 16 bytes"),
    ("symlink", ["s", "t", "float32", [[2]], "link", [0]], "not a regular file"),
    ("short descriptor", ["s", "t", "float32", [[2]], "data"], "shm column"),
    ("offsets not a list", ["s", "t", "float32", [[2]], "data", 0], "offsets must be a list"),
    ("one file per row, too many", ["s", "t", "float32", [[2]], ["data", "data"], [0]], "list of 1 names"),
    ("bad dtype", ["s", "t", "object", [[2]], "data", [0]], "dtype"),
]


@pytest.mark.parametrize("desc,message", [(d, m) for _, d, m in BAD_REFS], ids=[n for n, _, _ in BAD_REFS])
def test_malformed_references_get_an_error_and_the_server_keeps_serving(
    server: TransferQueueServer, desc: list[Any], message: str
) -> None:
    assert server.shm_dir is not None
    with open(os.path.join(server.shm_dir, "data"), "wb") as f:
        f.write(b"\x00" * 16)
    os.symlink("/etc/hostname", os.path.join(server.shm_dir, "link"))
    reply = raw_put(server, "train_0", desc)
    assert reply["ok"] is False and reply["kind"] == "invalid", reply
    assert message in reply["error"]
    q = client(server)
    assert q.partitions() == []  # nothing was recorded
    q.put("train_0", samples(1))
    assert q.get("train_0", "actor", ["x"], 1, timeout=2).indices == [0]
    q.close()


def test_a_valid_raw_reference_is_accepted(server: TransferQueueServer) -> None:
    assert server.shm_dir is not None
    with open(os.path.join(server.shm_dir, "data"), "wb") as f:
        f.write(np.arange(4, dtype=np.float32).tobytes())
    reply = raw_put(server, "train_0", ["s", "n", "float32", [[2]], "data", [8]])
    assert reply["ok"] is True, reply
    got = client(server).get("train_0", "actor", ["x"], 1, timeout=2).rows[0]["x"]
    np.testing.assert_array_equal(got, np.array([2.0, 3.0], dtype=np.float32))


def test_a_file_owned_by_another_partition_is_refused(server: TransferQueueServer) -> None:
    q = client(server)
    q.put("train_0", samples(1))
    (owned,) = payload_files(server)
    reply = raw_put(server, "train_1", ["s", "t", "float32", [[2]], owned, [0]])
    assert reply["ok"] is False and "belongs to partition 'train_0'" in reply["error"]
    assert payload_files(server) == [owned]  # the refusal did not delete train_0's data
    q.close()


def test_server_without_shm_refuses_references() -> None:
    srv = TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET, shm=False)
    srv.start()
    try:
        assert srv.shm_dir is None
        reply = raw_put(srv, "train_0", ["s", "t", "float32", [[2]], "data", [0]])
        assert reply["ok"] is False and "without a shared-memory directory" in reply["error"]
        assert TransferQueueClient(srv.address, secret=SECRET).shm_dir is None
    finally:
        srv.stop()


def test_cross_host_client_falls_back_to_tcp_and_reads_shm_rows(server: TransferQueueServer, monkeypatch: Any) -> None:
    local = client(server)
    local.put("train_0", samples(3))
    files_before = payload_files(server)
    # a client on another host reports another host id: its shm check fails
    monkeypatch.setattr(shm, "local_host_id", lambda: "elsewhere/boot")
    remote = client(server)
    assert remote.shm_dir is None
    batch = remote.get("train_0", "actor", ["x", "uid"], 3, timeout=5)  # the server inlines the bytes
    for i, row in enumerate(batch.rows):
        assert torch.equal(row["x"], torch.full((SAMPLE,), float(i)))  # type: ignore[arg-type]
    remote.put("train_0", samples(2, start=3))  # its own payloads travel over TCP
    assert payload_files(server) == files_before
    got = local.get("train_0", "reference", ["x", "uid"], 5, timeout=5)
    assert torch.equal(got.rows[4]["x"], torch.full((SAMPLE,), 4.0))  # type: ignore[arg-type]
    local.close()
    remote.close()


def test_same_host_client_sends_requests_over_the_unix_socket(server: TransferQueueServer, monkeypatch: Any) -> None:
    assert server.shm_dir is not None
    local = client(server)
    assert local.endpoint == f"ipc://{os.path.join(server.shm_dir, shm.SOCKET_FILE)}"
    local.put("train_0", samples(2))
    monkeypatch.setattr(shm, "local_host_id", lambda: "elsewhere/boot")
    remote = client(server)
    assert remote.endpoint == server.address  # another host: TCP, the only way there
    assert remote.get("train_0", "actor", ["uid"], 2, timeout=5).indices == [0, 1]
    assert local.get("train_0", "reference", ["uid"], 2, timeout=5).indices == [0, 1]
    local.close()
    remote.close()


def test_an_endpoint_outside_the_shm_directory_is_never_used(tmp_path: Any) -> None:
    directory = str(tmp_path)
    sock_path = os.path.join(directory, shm.SOCKET_FILE)
    open(sock_path, "w").close()
    assert shm.same_host_endpoint(directory, f"ipc://{sock_path}") == f"ipc://{sock_path}"
    assert shm.same_host_endpoint(directory, "ipc:///tmp/elsewhere.sock") is None
    assert shm.same_host_endpoint(directory, None) is None
    os.remove(sock_path)
    assert shm.same_host_endpoint(directory, f"ipc://{sock_path}") is None  # not there: stay on TCP


def test_env_switch_keeps_tcp(server: TransferQueueServer, monkeypatch: Any) -> None:
    monkeypatch.setenv("RELAX_TQ_SHM", "0")
    q = client(server)
    assert q.shm_dir is None
    q.put("train_0", samples(2))
    assert payload_files(server) == []
    q.close()


def test_small_puts_stay_inline(server: TransferQueueServer) -> None:
    q = client(server)
    assert q.shm_dir is not None
    q.put("train_0", [{"tokens": torch.arange(8), "reward": 1.0}])  # 64 bytes: below the cut-off
    assert payload_files(server) == []
    assert torch.equal(q.get("train_0", "actor", ["tokens"], 1, timeout=2).rows[0]["tokens"], torch.arange(8))  # type: ignore[arg-type]
    q.close()


def test_restarted_consumer_reads_unacked_rows_from_shm(server: TransferQueueServer) -> None:
    producer = client(server)
    producer.put("train_0", samples(6))
    producer.complete("train_0", 6)
    first = client(server)
    got = first.get("train_0", "actor", ["x", "uid"], 4, timeout=5)
    first.ack("train_0", "actor", got.indices[:2])
    first.close()  # dies with rows 2 and 3 un-acked
    files = payload_files(server)
    assert files  # the payloads are still there until the partition is cleared
    restarted = client(server)
    seen: dict[int, torch.Tensor] = {}
    while True:
        batch = restarted.get("train_0", "actor", ["x", "uid"], 3, timeout=5)
        for index, row in zip(batch.indices, batch.rows):
            seen[index] = row["x"]  # type: ignore[assignment]
        restarted.ack("train_0", "actor", batch.indices)
        if batch.end:
            break
    assert sorted(seen) == [2, 3, 4, 5]
    for index, tensor in seen.items():
        assert torch.equal(tensor, torch.full((SAMPLE,), float(index)))
    assert payload_files(server) == files
    restarted.clear("train_0")
    assert payload_files(server) == []
    producer.close()  # the producer deletes its released segments
    assert all_files(server) == []
    restarted.close()


def test_producer_reuses_released_segments(server: TransferQueueServer) -> None:
    q = client(server)
    q.put("train_0", samples(4))
    (first,) = payload_files(server)
    inode = os.stat(os.path.join(server.shm_dir or "", first)).st_ino
    q.clear("train_0")
    q.put("train_1", samples(4, start=10))
    (second,) = payload_files(server)
    assert second != first  # a new name: a stale reference to the old one cannot see new data
    assert os.stat(os.path.join(server.shm_dir or "", second)).st_ino == inode  # same memory
    batch = q.get("train_1", "actor", ["x"], 4, timeout=5)
    assert torch.equal(batch.rows[3]["x"], torch.full((SAMPLE,), 13.0))  # type: ignore[arg-type]
    assert all_files(server) == [second]
    q.close()


def test_reading_a_batch_whose_partition_is_cleared_meanwhile_fails_loudly(server: TransferQueueServer) -> None:
    q = client(server)
    q.put("train_0", samples(1))
    (name,) = payload_files(server)
    blocks = one_sample_reply(name)
    assert torch.equal(shm.read_blocks(server.shm_dir or "", blocks, [])[0]["x"], torch.zeros(SAMPLE))  # type: ignore[arg-type]
    q.clear("train_0")
    with pytest.raises(WireError, match="partition was cleared"):
        shm.read_blocks(server.shm_dir or "", blocks, [])
    q.close()


def test_a_consumer_reads_reused_segments_through_one_cached_mapping(server: TransferQueueServer) -> None:
    producer, consumer = client(server), client(server)
    maps = consumer._maps
    assert maps is not None
    for step in range(3):  # the producer refills one segment under a new name each step
        producer.put(f"train_{step}", samples(4, start=10 * step))
        batch = consumer.get(f"train_{step}", "actor", ["x"], 4, timeout=5)
        assert [float(r["x"][0]) for r in batch.rows] == [10.0 * step + i for i in range(4)]  # type: ignore[index]
        consumer.clear(f"train_{step}")
    assert len(maps._maps) == 1  # one inode, mapped once, read three times
    received = batch.rows[0]["x"]
    producer.put("train_3", samples(4, start=99))  # the segment is refilled again
    assert float(received[0]) == 20.0  # type: ignore[index]  # what was received owns its memory
    producer.close()
    consumer.close()


def test_a_cached_mapping_never_serves_a_name_that_was_released(server: TransferQueueServer) -> None:
    q = client(server)
    q.put("train_0", samples(1))
    (name,) = payload_files(server)
    blocks = one_sample_reply(name)
    maps = shm.ShmMaps(server.shm_dir or "")
    assert torch.equal(maps.read_blocks(blocks, [])[0]["x"], torch.zeros(SAMPLE))  # type: ignore[arg-type]
    q.clear("train_0")  # the name goes; the memory is still mapped here
    with pytest.raises(WireError, match="partition was cleared"):
        maps.read_blocks(blocks, [])
    maps.close()
    q.close()


def test_mappings_are_bounded_oldest_first(server: TransferQueueServer) -> None:
    q = client(server)
    maps = shm.ShmMaps(server.shm_dir or "", max_maps=2)
    names = []
    for step in range(3):  # three partitions alive at once: three segments
        q.put(f"train_{step}", samples(1, start=step))
        names.append(next(n for n in payload_files(server) if n not in names))
    for step, name in enumerate(names):
        blocks = one_sample_reply(name)
        rows = maps.read_blocks(blocks, [])
        assert float(rows[0]["x"][0]) == float(step)  # type: ignore[index]
    inodes = [os.stat(os.path.join(server.shm_dir or "", n)).st_ino for n in names]
    assert [key[1] for key in maps._maps] == inodes[1:]  # the first one was unmapped
    small = shm.ShmMaps(server.shm_dir or "", max_bytes=1)  # a mapping larger than the bound still serves
    blocks = one_sample_reply(names[2])
    assert float(small.read_blocks(blocks, [])[0]["x"][0]) == 2.0  # type: ignore[index]
    maps.close()
    small.close()
    q.close()


def test_a_killed_servers_directory_is_removed_by_the_next_server(tmp_path: Any) -> None:
    import signal
    import subprocess
    import sys

    root = tmp_path / "shm"
    root.mkdir()
    script = (
        "import sys, time\n"
        "from relax_hpc.auth import JobSecret\n"
        "from relax_hpc.transfer.zmq_server import TransferQueueServer\n"
        "secret = JobSecret.generate()\n"
        f"srv = TransferQueueServer('tcp://127.0.0.1:0', secret=secret, shm=True, shm_root={str(root)!r})\n"
        "srv.start()\n"
        "print(srv.shm_dir, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    killed_dir = proc.stdout.readline().strip()
    assert os.path.isdir(killed_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert os.path.isdir(killed_dir)  # nobody ran stop()
    # Directories whose owner cannot be checked are kept: no owner file, another pid namespace.
    (root / "relax-tq-noowner").mkdir()
    (root / "relax-tq-elsewhere").mkdir()
    (root / "relax-tq-elsewhere" / shm.OWNER_FILE).write_text("1 4026531836-not-this-namespace\n")
    live = TransferQueueServer("tcp://127.0.0.1:0", shm=True, shm_root=str(root), secret=SECRET)
    live.start()
    try:
        assert not os.path.exists(killed_dir)
        assert (root / "relax-tq-noowner").is_dir() and (root / "relax-tq-elsewhere").is_dir()
        # A live server's directory survives the next server's start.
        other = TransferQueueServer("tcp://127.0.0.1:0", shm=True, shm_root=str(root), secret=SECRET)
        other.start()
        assert live.shm_dir is not None and os.path.isdir(live.shm_dir)
        other.stop()
    finally:
        live.stop()
