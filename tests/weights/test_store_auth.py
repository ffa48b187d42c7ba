"""Who can reach the job's TCPStores: the weight channel's and the trainer's rendezvous store.

Real TCPStores and real gloo groups, ranks as threads of this process (and, for
`init_process_group`, as processes). The host listens only on the route address it is given (a
client via 127.0.0.1 is refused); every key lives under the job secret's prefix, and every
value is sealed with the secret (`weights.sealed_store`). A client without the secret can list
the key names (torch serves `list_keys` to anyone), but reads no plaintext, and what it writes
under a real key is refused with "without the job secret" rather than followed: no rank connects
to an address it planted (docs/weights.md, "Who can reach the store").
"""

from __future__ import annotations

import datetime
import gc
import ipaddress
import queue
import socket
import threading
import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from weights_harness import CTX, make_weights

from relax_hpc.auth import JobSecret
from relax_hpc.roles.actor import local_rank_on_node, trainer_store
from relax_hpc.weights.channel import WeightChannelReceiver, WeightChannelSender, WeightChannelTimeout
from relax_hpc.weights.group import TorchBroadcastGroup, host_store, local_address_towards, open_store
from relax_hpc.weights.layout import Header, encode_header, plan_buckets
from relax_hpc.weights.sealed_store import ForeignValueError, SealedStore, agree_epoch, seal_store

SHORT = datetime.timedelta(seconds=0.5)
REFUSED = "without the job secret"  # what a rank says of a value it will not follow


@pytest.fixture(scope="module")
def route_address() -> str:
    """This machine's address on the interface of its default route (UDP connect sends nothing)."""
    addr = local_address_towards("192.0.2.123", 9)  # any off-host address picks the default route
    try:
        addr = socket.getaddrinfo(addr, None, socket.AF_INET)[0][4][0]
    except socket.gaierror:
        pytest.skip(f"no non-loopback IPv4 interface: the route lookup gave {addr!r}, which does not resolve")
    if ipaddress.ip_address(addr).is_loopback:
        pytest.skip("no non-loopback IPv4 interface with a route off this machine (only lo): nothing to tell "
                    "a store on the route address from one on 127.0.0.1")
    return str(addr)


def _on_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run `fn` on a thread now; the returned function joins it and returns its result (or raises)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the joining thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    return join


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _intruder(host: str, port: int) -> dist.TCPStore:
    """A client of the store with no secret at all: what anyone who can route to the port gets."""
    return dist.TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=10), use_libuv=True)


def _listed(raw: dist.Store, looks_like: Callable[[str], bool], deadline_s: float = 30.0) -> str:
    """The first listed key that `looks_like` says is the one to attack, once a rank wrote it."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = sorted(k for k in raw.list_keys() if looks_like(k))
        if found:
            return found[0]
        time.sleep(0.01)
    raise AssertionError(f"no listed key looked right within {deadline_s} s: {raw.list_keys()}")


def _trainer_pair(host: str, secret: JobSecret) -> tuple[SealedStore, SealedStore, int]:
    port = _free_port(host)
    rank0 = _on_thread(lambda: trainer_store(host, port, 0, 2, secret))  # waits for rank 1
    store1 = trainer_store(host, port, 1, 2, secret)
    return rank0(), store1, port


# --------------------------------------------------------------------------- where the store listens
def test_store_on_the_route_address_refuses_loopback_clients(route_address: str) -> None:
    store = open_store(route_address, 0, 2, True, 5.0)
    assert store.port > 0 and store.host == route_address  # port 0 picked a free port, and we learn it
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", store.port), timeout=5).close()
    with pytest.raises(ConnectionError, match="could not reach the TCP store at 127.0.0.1"):
        open_store("127.0.0.1", store.port, 2, False, 0.5)
    store.set("k", b"v")
    assert open_store(route_address, store.port, 2, False, 5.0).get("k") == b"v"


def test_a_host_name_is_resolved_and_a_wildcard_is_refused() -> None:
    store = host_store("localhost", 0, 1, SHORT)
    assert ipaddress.ip_address(store.host).is_loopback
    for wildcard in ("0.0.0.0", "", "::"):
        with pytest.raises(ValueError, match="not a wildcard"):
            host_store(wildcard, 0, 1, SHORT)


def test_a_busy_port_is_named() -> None:
    first = host_store("127.0.0.1", 0, 1, SHORT)
    with pytest.raises(ConnectionError, match=f"cannot listen on 127.0.0.1:{first.port}"):
        open_store("127.0.0.1", first.port, 2, True, 1.0)


# --------------------------------------------------------------------------- sealed values
def test_values_are_sealed_and_bound_to_their_key() -> None:
    secret, raw = JobSecret.generate(), dist.HashStore()
    store = seal_store(raw, secret, "weights")
    store.set("a", "10.1.2.3:4567")  # str, as local_rank_on_node writes, or bytes, as gloo does
    store.set("b", b"other")
    assert store.get("a") == b"10.1.2.3:4567" and store.get("b") == b"other"
    assert b"10.1.2.3" not in raw.get(_raw_key(secret, "weights", "a"))
    # A genuine value, moved to another key, does not open there.
    raw.set(_raw_key(secret, "weights", "b"), raw.get(_raw_key(secret, "weights", "a")))
    with pytest.raises(ForeignValueError, match=f"'b'.*{REFUSED}"):
        store.get("b")
    # Nor does a value sealed with another job's secret under the right name, or one from the
    # job's other store ("trainer" vs "weights"), or bytes that are no sealed value at all.
    for other_secret, other_name in ((JobSecret.generate(), "weights"), (secret, "trainer")):
        other_raw = dist.HashStore()
        seal_store(other_raw, other_secret, other_name).set("a", b"forged")
        raw.set(_raw_key(secret, "weights", "a"), other_raw.get(_raw_key(other_secret, other_name, "a")))
        with pytest.raises(ForeignValueError, match=REFUSED):
            store.get("a")
    raw.set(_raw_key(secret, "weights", "a"), b"short")
    with pytest.raises(ForeignValueError, match=REFUSED):
        store.get("a")


def _raw_key(secret: JobSecret, name: str, key: str) -> str:
    """Where `seal_store(raw, secret, name)` keeps `key` in `raw` (PrefixStore joins with '/')."""
    return f"{secret.store_prefix(name)}/{key}"


def test_sealed_store_speaks_every_store_call_torch_makes() -> None:
    raw = dist.HashStore()
    store = seal_store(raw, JobSecret.generate(), "trainer")
    # Through a PrefixStore, as process groups use it: every call crosses torch's trampoline,
    # which looks up deleteKey and getNumKeys by their C++ names.
    view = dist.PrefixStore("pg", store)
    view.set("k", b"v")
    assert view.get("k") == b"v" and view.check(["k"]) and not view.check(["missing"])
    view.wait(["k"])
    view.wait(["k"], SHORT)
    assert view.add("n", 2) == 2 and view.add("n", 3) == 5  # counters stay plain integers
    assert view.compare_set("k", b"v", b"w") == b"w" and view.get("k") == b"w"
    assert view.compare_set("k", b"stale", b"x") == b"w" and view.get("k") == b"w"
    assert view.compare_set("new", b"", b"y") == b"y" and view.get("new") == b"y"
    assert view.compare_set("absent", b"e", b"z") == b"e" and not view.check(["absent"])
    view.append("log", b"a")
    view.append("log", b"b")
    assert view.get("log") == b"ab"
    view.multi_set(["m1", "m2"], [b"1", b"2"])
    assert view.multi_get(["m1", "m2"]) == [b"1", b"2"]
    assert store.num_keys() == raw.num_keys() == view.num_keys() == 6
    assert view.delete_key("m1") and not view.check(["m1"])
    # A timeout set through a C++ wrapper reaches the store the values live in.
    view.set_timeout(SHORT)
    assert store.timeout == SHORT
    with pytest.raises(RuntimeError):
        view.get("never")
    assert store.clone().get("pg/k") == b"w"


# --------------------------------------------------------------------------- what the secret keeps apart
def test_wrong_secret_neither_reads_nor_disturbs_a_real_broadcast(route_address: str) -> None:
    secret, intruder_secret = JobSecret.generate(), JobSecret.generate()
    sender = WeightChannelSender(route_address, 0, 1, timeout_s=30, secret=secret)
    intruder = seal_store(open_store(route_address, sender.port, 2, False, 5.0), intruder_secret, "weights")
    intruder.set_timeout(SHORT)
    # Everything a receiver writes, for broadcast #0: had it landed among the channel's keys, the
    # sender would count rank 1 as joined, ready and done.
    for key in ("joined/1", "ready/0/1", "ack/0/1"):
        intruder.set(key, b"1")
        assert not sender.store.check([key])
    # Rendezvous as rank 1 of the channel's gloo group: rank 0 never shows under that prefix.
    with pytest.raises(RuntimeError):
        TorchBroadcastGroup(intruder, 1, 2, "gloo", 1.0, bind_host=route_address)

    receiver = WeightChannelReceiver(route_address, sender.port, 1, 1, timeout_s=30, secret=secret)
    got: dict[str, torch.Tensor] = {}
    received = _on_thread(lambda: receiver.receive(lambda bucket: got.update({n: t.clone() for n, t in bucket})))
    weights = make_weights(7)
    try:
        assert sender.broadcast(weights, version=1) == 1
        assert received() == 1
    finally:
        sender.close()
        receiver.close()
    assert all(torch.equal(got[name], t) for name, t in weights), "a received tensor differs"
    # The header of broadcast #0 is still in the store (the next broadcast deletes it), under the
    # secret's prefix only.
    assert sender.store.check(["header/0"])
    with pytest.raises(RuntimeError):
        intruder.get("header/0")


def test_wrong_secret_receiver_times_out_instead_of_joining(route_address: str) -> None:
    sender = WeightChannelSender(route_address, 0, 1, timeout_s=30, secret=JobSecret.generate())
    sender.store.set("header/0", b"{}")  # what a broadcast publishes first
    try:
        stranger = WeightChannelReceiver(
            route_address, sender.port, 1, 1, timeout_s=0.5, secret=JobSecret.generate()
        )
        with pytest.raises(WeightChannelTimeout, match="published no broadcast #0"):
            stranger.receive(lambda bucket: None)
        assert not sender.store.check(["joined/1"])
    finally:
        sender.close()


def test_trainer_store_rendezvous_stays_under_the_secret_prefix(route_address: str) -> None:
    secret = JobSecret.generate()
    store0, store1, port = _trainer_pair(route_address, secret)
    assert (local_rank_on_node(store0, 0), local_rank_on_node(store1, 1)) == (0, 1)
    making0 = _on_thread(lambda: TorchBroadcastGroup(store0, 0, 2, "gloo", 10.0, bind_host=route_address))
    group1 = TorchBroadcastGroup(store1, 1, 2, "gloo", 10.0, bind_host=route_address)
    group0 = making0()
    sent, arrived = torch.arange(5.0), torch.zeros(5)
    sending = _on_thread(lambda: group0.broadcast(sent, 0).wait())
    group1.broadcast(arrived, 0).wait()
    sending()
    group0.close()
    group1.close()
    assert torch.equal(arrived, sent)
    keys = _intruder(route_address, port).list_keys()
    prefix = secret.store_prefix("trainer")
    assert keys and all(k.startswith(prefix) for k in keys), keys
    stranger = seal_store(dist.TCPStore(route_address, port, 2, False, timeout=SHORT), JobSecret.generate(), "trainer")
    with pytest.raises(RuntimeError):
        stranger.get("relax_hpc/trainer_host/0")


# --------------------------------------------------------------------------- a client that lists the keys
def test_what_remains_any_client_lists_the_key_names_but_reads_no_value(route_address: str) -> None:
    # TCPStore serves list_keys to every client, so the prefix is no secret: this pins that
    # (docs/weights.md says so) and that every value a rank wrote is sealed: neither the address
    # gloo publishes (binary), nor the host name, nor the header's JSON appear in the raw bytes.
    secret = JobSecret.generate()
    store0, store1, port = _trainer_pair(route_address, secret)
    local_rank_on_node(store0, 0)
    local_rank_on_node(store1, 1)
    making0 = _on_thread(lambda: TorchBroadcastGroup(store0, 0, 2, "gloo", 10.0, bind_host=route_address))
    group1 = TorchBroadcastGroup(store1, 1, 2, "gloo", 10.0, bind_host=route_address)
    making0().close()
    group1.close()
    sender = WeightChannelSender(route_address, 0, 1, timeout_s=30, secret=secret)
    receiver = WeightChannelReceiver(route_address, sender.port, 1, 1, timeout_s=30, secret=secret)
    received = _on_thread(lambda: receiver.receive(lambda bucket: None))
    try:
        assert sender.broadcast(make_weights(3), version=1) == 1
        assert received() == 1
    finally:
        sender.close()
        receiver.close()
    plaintexts = [route_address.encode(), socket.inet_aton(route_address), socket.gethostname().encode(),
                  b"version", b"buckets"]
    # A needle of 2 or 3 bytes (a host named "vm") turns up in random ciphertext by chance (a
    # 2-byte one in about 1 value in 600 of this size): only 4 bytes and more say anything.
    plaintexts = [p for p in plaintexts if len(p) >= 4]
    for raw, name in ((_intruder(route_address, port), "trainer"), (_intruder(route_address, sender.port), "weights")):
        listed = raw.list_keys()
        assert listed and all(k.startswith(secret.store_prefix(name)) for k in listed), listed
        for key in listed:
            value = raw.get(key)
            leaked = [p for p in plaintexts if p in value]
            assert not leaked, f"{key}: raw value shows {leaked}"


def test_an_intruder_that_overwrites_a_gloo_address_is_refused_not_followed(route_address: str) -> None:
    secret = JobSecret.generate()
    store0, store1, port = _trainer_pair(route_address, secret)
    intruder = _intruder(route_address, port)
    # Both ranks agree on the rendezvous's epoch first (TorchBroadcastGroup does so itself when
    # given a store that has not), so that rank 0 can publish its address before rank 1 starts.
    agreeing0 = _on_thread(lambda: agree_epoch(store0, 0, 2, "pg/channel/gloo"))
    store1 = agree_epoch(store1, 1, 2, "pg/channel/gloo")
    store0 = agreeing0()
    # Rank 0 publishes its gloo address and waits for rank 1's; the intruder lists the keys, finds
    # rank 0's and puts its own address there before rank 1 reads it.
    # Rank 0's timeout is short: when it waits for rank 1 it waits it out (gloo: five times over).
    making0 = _on_thread(lambda: TorchBroadcastGroup(store0, 0, 2, "gloo", 1.0, bind_host=route_address))
    key = _listed(intruder, lambda k: "/pg/" in k and k.endswith("/0"))
    intruder.set(key, socket.inet_aton(route_address) + b"\x00" * 64)
    with pytest.raises(ForeignValueError, match=REFUSED):
        TorchBroadcastGroup(store1, 1, 2, "gloo", 3.0, bind_host=route_address)
    # Rank 0's end is a race, not a finding: it times out waiting for rank 1, or it completes its
    # half first (rank 1 published its own address before it read rank 0's forged one). Either
    # way nobody connected to the intruder; join it so nothing outlives the test.
    try:
        making0().close()
    except RuntimeError:
        pass
    # The same for a plain get: the host name local_rank_on_node reads.
    local_rank_on_node(store0, 0)
    host_key = _listed(intruder, lambda k: k.endswith("trainer_host/0"))
    intruder.set(host_key, socket.gethostname().encode())
    with pytest.raises(ForeignValueError, match=f"trainer_host/0.*{REFUSED}"):
        local_rank_on_node(store1, 1)


def test_an_intruder_that_overwrites_a_broadcast_header_is_refused(route_address: str) -> None:
    secret = JobSecret.generate()
    sender = WeightChannelSender(route_address, 0, 1, timeout_s=3, secret=secret)
    intruder = _intruder(route_address, sender.port)
    weights = make_weights(5)
    pending = sender.broadcast_async(weights, version=1)
    header_key = _listed(intruder, lambda k: k.endswith("header/0"))
    # A well-formed header of the intruder's own: an unsealed channel would have followed it.
    intruder.set(header_key, encode_header(Header(99, 0, "gloo", plan_buckets(weights, 1 << 20, 1 << 20))))
    receiver = WeightChannelReceiver(route_address, sender.port, 1, 1, timeout_s=3, secret=secret)
    try:
        with pytest.raises(ForeignValueError, match=f"header/0.*{REFUSED}"):
            receiver.receive(lambda bucket: None)
        with pytest.raises(RuntimeError):  # the sender's broadcast fails: nobody received
            pending.wait()
    finally:
        sender.close()
        receiver.close()


# --------------------------------------------------------------------------- init_process_group
def _trainer_rank(host: str, port: int, rank: int, secret: JobSecret, out: Any) -> None:
    """One trainer rank as ActorWorker starts it: the sealed trainer store, then the default group."""
    try:
        torch.set_num_threads(1)
        store = trainer_store(host, port, rank, 2, secret)
        local_rank = local_rank_on_node(store, rank)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        del store
        gc.collect()  # torch holds only the C++ half; trainer_store keeps the Python one alive
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        pair = dist.new_group([0, 1])  # a second rendezvous through the same store, later on
        dist.all_reduce(t, group=pair)
        dist.destroy_process_group()
        out.put((rank, local_rank, t.tolist()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put((rank, -1, f"{type(exc).__name__}: {exc}"))


def test_init_process_group_runs_over_the_sealed_trainer_store(route_address: str) -> None:
    secret, port, out = JobSecret.generate(), _free_port(route_address), CTX.Queue()
    procs = [CTX.Process(target=_trainer_rank, args=(route_address, port, r, secret, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=120) for _ in procs)
    except queue.Empty:
        pytest.fail("a trainer rank did not report within 120 s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results == [(0, 0, [6.0, 6.0, 6.0]), (1, 1, [6.0, 6.0, 6.0])], results
