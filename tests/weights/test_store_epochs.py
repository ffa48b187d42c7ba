"""Sealed store values are bound to an epoch as well as to their key (issue 33, item 10): a value
recorded in one attempt of the job, or in one rendezvous, and put back into the next does not open
there, though the secret and the key names are the same.

Real TCPStores on 127.0.0.1, real sealed values read back as the raw bytes a client without the
secret sees and writes (that client can list and set keys; weights/sealed_store.py).
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import pytest
import torch.distributed as dist

from relax_hpc.auth import JobSecret
from relax_hpc.weights.group import TorchBroadcastGroup, host_store
from relax_hpc.weights.sealed_store import ForeignValueError, SealedStore, agree_epoch, attempt_epoch, seal_store

TIMEOUT = datetime.timedelta(seconds=10)
ADDRESS_KEY = "pg/channel/gloo/rank_1"  # stands for the address a rank publishes in a rendezvous


def _pair() -> tuple[dist.TCPStore, dist.TCPStore]:
    """A fresh TCPStore (a new rendezvous: a requeued attempt, a rebuilt channel) and a client of it."""
    host = host_store("127.0.0.1", 0, 2, TIMEOUT)
    return host, dist.TCPStore("127.0.0.1", host.port, 2, False, timeout=TIMEOUT, use_libuv=True)


def _raw_key(raw: dist.Store, key: str) -> str:
    """The one listed key that ends in `key` (the secret's prefix before it)."""
    [found] = [k for k in raw.list_keys() if k.endswith(key)]
    return found


def _set_seen(store: SealedStore, key: str, value: bytes) -> None:
    """Set `key` through `store` and read it back on the same connection: a TCPStore client's set
    is not answered, so another connection's `list_keys` could run before the server has it."""
    store.set(key, value)
    assert store.get(key) == value


def _agree(stores: list[SealedStore]) -> list[SealedStore]:
    """Every rank's `agree_epoch`, ranks as threads."""
    out: list[Any] = [None] * len(stores)

    def run(rank: int) -> None:
        try:
            out[rank] = agree_epoch(stores[rank], rank, len(stores), "g")
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for value in out:
        if isinstance(value, BaseException):
            raise value
    return out


def test_a_value_sealed_in_one_attempt_does_not_open_in_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = JobSecret.generate()  # a requeue keeps the secret
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    first, first_client = _pair()
    _set_seen(seal_store(first_client, secret, "weights"), ADDRESS_KEY, b"10.0.0.7:41000")
    recorded = first.get(_raw_key(first, ADDRESS_KEY))  # what anyone who reaches the port can read
    assert seal_store(first, secret, "weights").get(ADDRESS_KEY) == b"10.0.0.7:41000"  # same attempt: opens

    monkeypatch.setenv("SLURM_RESTART_COUNT", "4")  # the next attempt: a new store, the same secret and keys
    second, _ = _pair()
    store = seal_store(second, secret, "weights")
    second.set(_raw_key(first, ADDRESS_KEY), recorded)  # put back before the rank writes its own
    with pytest.raises(ForeignValueError, match="earlier attempt or rendezvous"):
        store.get(ADDRESS_KEY)
    assert attempt_epoch({"SLURM_RESTART_COUNT": "4"}) == b"attempt/4" and attempt_epoch({}) == b"attempt/0"


def test_a_value_of_one_rendezvous_does_not_open_in_the_next_of_the_same_attempt() -> None:
    """A global restart or a rebuilt channel: same attempt, new store, new agreed epoch."""
    secret = JobSecret.generate()
    first, first_client = _pair()
    ranks = _agree([seal_store(first, secret, "weights"), seal_store(first_client, secret, "weights")])
    assert all(r.agreed for r in ranks) and ranks[0].epoch == ranks[1].epoch
    ranks[1].set(ADDRESS_KEY, b"10.0.0.7:41000")
    assert ranks[0].get(ADDRESS_KEY) == b"10.0.0.7:41000"  # the rendezvous itself works
    recorded = first.get(_raw_key(first, ADDRESS_KEY))

    second, second_client = _pair()
    base = seal_store(second, secret, "weights")
    again = _agree([base, seal_store(second_client, secret, "weights")])
    assert again[0].epoch != ranks[0].epoch
    second.set(_raw_key(first, ADDRESS_KEY), recorded)
    with pytest.raises(ForeignValueError, match=ADDRESS_KEY):
        again[0].get(ADDRESS_KEY)
    # What the agreed epoch adds: a value sealed in the attempt's epoch alone would open here.
    plain = seal_store(first_client, secret, "weights")
    _set_seen(plain, "plain", b"10.0.0.7:41000")
    second.set(_raw_key(first, "/plain"), first.get(_raw_key(first, "/plain")))
    assert base.get("plain") == b"10.0.0.7:41000"


def test_a_recorded_epoch_list_is_refused_by_the_rank_it_does_not_hold() -> None:
    secret = JobSecret.generate()
    first, first_client = _pair()
    _agree([seal_store(first, secret, "weights"), seal_store(first_client, secret, "weights")])
    all_key = _raw_key(first, "relax_hpc/epoch/g/all")
    recorded = first.get(all_key)

    second, second_client = _pair()
    second.set(all_key, recorded)  # put back before rank 0 publishes this rendezvous's list
    with pytest.raises(ForeignValueError, match="does not hold rank 1's draw"):
        agree_epoch(seal_store(second_client, secret, "weights"), 1, 2, "g")


def test_a_gloo_group_forms_in_its_agreed_epoch() -> None:
    """TorchBroadcastGroup agrees on the epoch itself and broadcasts over it."""
    import torch

    secret = JobSecret.generate()
    host, client = _pair()
    stores = [seal_store(host, secret, "weights"), seal_store(client, secret, "weights")]
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        group = TorchBroadcastGroup(stores[r], r, 2, "gloo", 10.0, bind_host="127.0.0.1")
        t = torch.full((3,), 7.0) if r == 0 else torch.zeros(3)
        group.broadcast(t, 0).wait()
        out[r] = (group.store.agreed, group.store.epoch, t.tolist())
        group.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0] is not None and out[1] is not None
    assert out[0][0] and out[0][1] == out[1][1] and out[1][2] == [7.0, 7.0, 7.0]
