"""`SealedStore`: a torch.distributed Store whose values nobody without the job secret can read or forge.

    store = seal_store(tcp_store, job_secret(), "weights")   # or "trainer"
    store.set("k", b"v"); store.get("k")                     # as any Store; on the wire: sealed
    dist.init_process_group("gloo", store=store, ...)        # gloo / NCCL rendezvous through it

A TCPStore has no authentication, and torch 2.13 serves ``list_keys()`` to every client, so a
key prefix hides nothing from a client that lists the keys. `SealedStore` wraps the job's
prefixed store and seals every value with AES-256-GCM under a key derived from the job secret
(``secret.derive("store-seal/<name>")``), with the epoch and the key name as associated data: a
value that was not sealed by the job, that was moved from another key, or that was recorded in an
earlier epoch and put back (a replay) does not open, and `get` raises `ForeignValueError` instead
of handing gloo or NCCL a peer address an intruder chose. A client
without the secret can still list the key names, delete keys, and write garbage or bump the
counters of `add` (which must stay plain integers for the store to count): a denial of
service, never a hijack. docs/weights.md, "Who can reach the store", has the whole picture.

Epochs. The secret, and so the sealing key, is the same in every attempt of a job (a requeue
keeps it) and in every rendezvous of one attempt (a global restart rebuilds the roles, a weight
channel is rebuilt on a new port), so the key name alone would let a value recorded in one
rendezvous open in the next. Two epochs keep them apart:

* `seal_store` binds every value to the job's attempt (`attempt_epoch`: Slurm's
  SLURM_RESTART_COUNT, which every process of one attempt inherits from the batch script);
* `agree_epoch` binds a rendezvous to a fresh epoch of its own: every rank draws 16 random
  bytes, rank 0 collects them and publishes the list (sealed), every rank checks that the list
  holds its own draw, and the epoch is the hash of the list. A recorded list or value of an
  earlier rendezvous cannot hold this one's draws, so it does not open. `TorchBroadcastGroup`
  forms its gloo / NCCL group over the agreed epoch (weights/group.py).

It is a Python subclass of `torch.distributed.Store`, which torch passes to C++ process groups
through its PythonStore trampoline. Two quirks of that trampoline (torch 2.13), both checked
in tests/weights/test_store_auth.py:

* it looks up ``deleteKey`` and ``getNumKeys`` by their C++ names, so both spellings exist here;
* C++ holds only the C++ half of the object: once the Python object is collected, a process
  group that still uses it fails with "Not implemented". Keep a reference for as long as any
  group (or a `PrefixStore` over it) lives: `TorchBroadcastGroup` keeps its store, and a store
  handed to `init_process_group` goes through `keep_until_exit`.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from typing import Mapping, Sequence

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from relax_hpc.auth import JobSecret

__all__ = ["ForeignValueError", "SealedStore", "agree_epoch", "attempt_epoch", "keep_until_exit", "seal_store"]

_NONCE_BYTES = 12  # AES-GCM's standard nonce, random per value
_TAG_BYTES = 16
_DRAW_BYTES = 16  # each rank's random contribution to a rendezvous's epoch
_MAX_EPOCH_BYTES = 1024
_KEPT: list[SealedStore] = []


class ForeignValueError(dist.DistStoreError):
    """A store value that does not open with the job secret: something outside the job wrote it."""


def _as_bytes(value: str | bytes | bytearray | memoryview) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SealedStore(dist.Store):
    """`inner` with every value sealed under `key` (32 bytes) and bound to `epoch`; see the
    module docstring."""

    def __init__(self, inner: dist.Store, key: bytes, name: str = "store", epoch: bytes = b"") -> None:
        super().__init__()
        if len(epoch) > _MAX_EPOCH_BYTES:
            raise ValueError(f"a store epoch is at most {_MAX_EPOCH_BYTES} bytes, got {len(epoch)}")
        self._inner, self._aead, self.name, self.epoch = inner, AESGCM(key), name, bytes(epoch)
        self._key = key  # for clone()
        self.agreed = False  # in the epoch `agree_epoch` gave one rendezvous
        super().set_timeout(inner.timeout)

    def in_epoch(self, epoch: bytes) -> SealedStore:
        """The same store with values bound to this store's epoch and then `epoch` (a rendezvous
        within the attempt); values of this store and of other epochs do not open there. Keep the
        returned object alive as long as a process group uses it (module docstring)."""
        view = SealedStore(self._inner, self._key, self.name, self.epoch + b"/" + epoch)
        view.set_timeout(self.timeout)
        return view

    # ------------------------------------------------------------------ sealing
    def _associated(self, key: str) -> bytes:
        """What a value is bound to besides the key: (epoch, key name), length-prefixed so no two
        pairs give the same bytes."""
        return len(self.epoch).to_bytes(2, "big") + self.epoch + key.encode()

    def _seal(self, key: str, value: bytes) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, value, self._associated(key))

    def _open(self, key: str, sealed: bytes) -> bytes:
        try:
            if len(sealed) < _NONCE_BYTES + _TAG_BYTES:
                raise InvalidTag
            return self._aead.decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], self._associated(key))
        except InvalidTag:
            raise ForeignValueError(
                f"{self.name} store key {key!r}: its value does not open with this job's secret in this "
                "rendezvous, so something without the job secret wrote it (another user's process on the "
                "cluster network, or a rank started with another job's secret), or it was recorded in an "
                "earlier attempt or rendezvous and put back; it is refused. Check that every rank reads the "
                "same job secret (RELAX_HPC_SECRET_FILE), runs in the same attempt of the job, and who else "
                "can reach this store's port (docs/weights.md, \"Who can reach the store\")"
            ) from None

    def _store(self) -> dist.Store:
        """`inner`, with this store's timeout: C++ wrappers (`PrefixStore.set_timeout`) set only ours."""
        if self._inner.timeout != self.timeout:
            self._inner.set_timeout(self.timeout)
        return self._inner

    # ------------------------------------------------------------------ values: sealed
    def set(self, key: str, value: str | bytes) -> None:
        self._store().set(key, self._seal(key, _as_bytes(value)))

    def get(self, key: str) -> bytes:
        """The value under `key` (waiting for it, as the inner store does); `ForeignValueError`
        when it was not sealed by the job."""
        return self._open(key, self._store().get(key))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set `desired` if the value is `expected` (or the key is missing and `expected` empty);
        returns the value now held. Atomic: the inner swap compares the sealed bytes read here."""
        store, expected_b, desired_b = self._store(), _as_bytes(expected), _as_bytes(desired)
        sealed_now = store.get(key) if store.check([key]) else b""
        if sealed_now:
            current = self._open(key, sealed_now)
            if current != expected_b:
                return current
        elif expected_b:
            return expected_b  # as TCPStore and HashStore answer for a missing key
        sealed = self._seal(key, desired_b)
        got = store.compare_set(key, sealed_now, sealed)
        return desired_b if got == sealed else self._open(key, got)

    def append(self, key: str, value: str | bytes) -> None:
        store = self._store()
        while True:
            sealed_now = store.get(key) if store.check([key]) else b""
            old = self._open(key, sealed_now) if sealed_now else b""
            sealed = self._seal(key, old + _as_bytes(value))
            if store.compare_set(key, sealed_now, sealed) == sealed:
                return

    # ------------------------------------------------------------------ counters and key names: plain
    def add(self, key: str, amount: int) -> int:
        """A plain counter: the store adds integers itself, so it cannot be sealed (a client
        without the secret can bump it: a denial of service, e.g. a barrier that returns early
        or never, not a hijack). Read a counter with ``add(key, 0)``, never with `get`."""
        return self._store().add(key, amount)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        store = self._store()
        if timeout is None:
            store.wait(list(keys))
        else:
            store.wait(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._store().check(list(keys))

    def delete_key(self, key: str) -> bool:
        return self._store().delete_key(key)

    deleteKey = delete_key  # the name torch's trampoline calls

    def num_keys(self) -> int:
        return self._store().num_keys()

    getNumKeys = num_keys  # the name torch's trampoline calls

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        super().set_timeout(timeout)
        self._inner.set_timeout(timeout)

    def clone(self) -> SealedStore:
        return SealedStore(self._inner.clone(), self._key, self.name, self.epoch)


def attempt_epoch(env: Mapping[str, str] | None = None) -> bytes:
    """The job's attempt as a store epoch: ``attempt/<SLURM_RESTART_COUNT>`` (0 when unset: the
    first attempt, or a run outside Slurm, whose secret is fresh for every run)."""
    count = (os.environ if env is None else env).get("SLURM_RESTART_COUNT", "").strip() or "0"
    if not count.isdigit():
        raise ValueError(f"SLURM_RESTART_COUNT={count!r} is not a whole number; it is Slurm's to set, unset it")
    return f"attempt/{int(count)}".encode()


def seal_store(store: dist.Store, secret: JobSecret, name: str, epoch: bytes | None = None) -> SealedStore:
    """The job's view of `store` for `name` ("weights", "trainer"): keys under the secret's prefix,
    values sealed with a key derived for that store alone and bound to `epoch` (default: the
    job's attempt, `attempt_epoch()`).

    The sealing key comes from its own purpose (``store-seal/<name>``), not from ``store/<name>``,
    whose first 16 bytes are the key prefix that any client can list.
    """
    prefixed = dist.PrefixStore(secret.store_prefix(name), store)
    return SealedStore(prefixed, secret.derive(f"store-seal/{name}"), name,
                       attempt_epoch() if epoch is None else epoch)


def agree_epoch(store: SealedStore, rank: int, size: int, group: str = "group") -> SealedStore:
    """Bind one rendezvous of ranks 0..size-1 on `store` to a fresh epoch (module docstring);
    every rank calls it with the same `group`, and gets the store in that epoch.

    A store agreed on already (`.agreed`) is not agreed on again by `TorchBroadcastGroup`.
    Raises ForeignValueError when the list rank 0 published does not hold this rank's draw (it
    was put back from an earlier rendezvous, or rank 0 read a draw put back in this rank's place).
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not one of the group's {size} ranks")
    draw = os.urandom(_DRAW_BYTES)
    if size == 1:
        return _agreed(store, [draw])
    base = f"relax_hpc/epoch/{group}"
    if rank == 0:
        draws = [draw] + [store.get(f"{base}/draw/{r}") for r in range(1, size)]
        if any(len(d) != _DRAW_BYTES for d in draws):
            raise ForeignValueError(f"{store.name} store group {group!r}: a rank's epoch draw is not "
                                    f"{_DRAW_BYTES} bytes; a rank of another version of relax-hpc?")
        store.set(f"{base}/all", b"".join(draws))
    else:
        store.set(f"{base}/draw/{rank}", draw)
        joined = store.get(f"{base}/all")
        draws = [joined[i:i + _DRAW_BYTES] for i in range(0, len(joined), _DRAW_BYTES)]
        if len(draws) != size or draws[rank] != draw:
            raise ForeignValueError(
                f"{store.name} store group {group!r}: the epoch rank 0 published does not hold rank {rank}'s "
                "draw, so it, or the draw rank 0 read, was recorded in an earlier rendezvous and put back by "
                "something that can reach the store's port; the rendezvous is refused. Rebuild the group (a "
                "new store on a new port) and check who else can reach it (docs/weights.md, \"Who can reach "
                "the store\")")
    return _agreed(store, draws)


def _agreed(store: SealedStore, draws: list[bytes]) -> SealedStore:
    bound = store.in_epoch(hashlib.sha256(b"".join(draws)).hexdigest().encode())
    bound.agreed = True
    return bound


def keep_until_exit(store: SealedStore) -> SealedStore:
    """Keep `store` alive for the rest of the process (returns it).

    For a store handed to `init_process_group`: torch keeps only its C++ half for the default
    group (module docstring), which lives until the process ends.
    """
    _KEPT.append(store)
    return store
