"""`SealedStore`: a torch.distributed Store whose values nobody without the job secret can read or forge.

    store = seal_store(tcp_store, job_secret(), "weights")   # or "trainer"
    store.set("k", b"v"); store.get("k")                     # as any Store; on the wire: sealed
    dist.init_process_group("gloo", store=store, ...)        # gloo / NCCL rendezvous through it

A TCPStore has no authentication, and torch 2.13 serves ``list_keys()`` to every client, so a
key prefix hides nothing from a client that lists the keys. `SealedStore` wraps the job's
prefixed store and seals every value with AES-256-GCM under a key derived from the job secret
(``secret.derive("store-seal/<name>")``), with the key name as associated data: a value that
was not sealed by the job, or that was moved from another key, does not open, and `get` raises
`ForeignValueError` instead of handing gloo or NCCL a peer address an intruder chose. A client
without the secret can still list the key names, delete keys, and write garbage or bump the
counters of `add` (which must stay plain integers for the store to count): a denial of
service, never a hijack. docs/weights.md, "Who can reach the store", has the whole picture.

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
import os
from typing import Sequence

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from relax_hpc.auth import JobSecret

__all__ = ["ForeignValueError", "SealedStore", "keep_until_exit", "seal_store"]

_NONCE_BYTES = 12  # AES-GCM's standard nonce, random per value
_TAG_BYTES = 16
_KEPT: list[SealedStore] = []


class ForeignValueError(dist.DistStoreError):
    """A store value that does not open with the job secret: something outside the job wrote it."""


def _as_bytes(value: str | bytes | bytearray | memoryview) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class SealedStore(dist.Store):
    """`inner` with every value sealed under `key` (32 bytes); see the module docstring."""

    def __init__(self, inner: dist.Store, key: bytes, name: str = "store") -> None:
        super().__init__()
        self._inner, self._aead, self.name = inner, AESGCM(key), name
        self._key = key  # for clone()
        super().set_timeout(inner.timeout)

    # ------------------------------------------------------------------ sealing
    def _seal(self, key: str, value: bytes) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, value, key.encode())

    def _open(self, key: str, sealed: bytes) -> bytes:
        try:
            if len(sealed) < _NONCE_BYTES + _TAG_BYTES:
                raise InvalidTag
            return self._aead.decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], key.encode())
        except InvalidTag:
            raise ForeignValueError(
                f"{self.name} store key {key!r}: its value does not open with this job's secret, so "
                "something without the job secret wrote it (another user's process on the cluster network, "
                "or a rank started with another job's secret), and it is refused. Check that every rank "
                "reads the same job secret (RELAX_HPC_SECRET_FILE) and who else can reach this store's "
                "port (docs/weights.md, \"Who can reach the store\")"
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
        return SealedStore(self._inner.clone(), self._key, self.name)


def seal_store(store: dist.Store, secret: JobSecret, name: str) -> SealedStore:
    """The job's view of `store` for `name` ("weights", "trainer"): keys under the secret's prefix,
    values sealed with a key derived for that store alone.

    The sealing key comes from its own purpose (``store-seal/<name>``), not from ``store/<name>``,
    whose first 16 bytes are the key prefix that any client can list.
    """
    prefixed = dist.PrefixStore(secret.store_prefix(name), store)
    return SealedStore(prefixed, secret.derive(f"store-seal/{name}"), name)


def keep_until_exit(store: SealedStore) -> SealedStore:
    """Keep `store` alive for the rest of the process (returns it).

    For a store handed to `init_process_group`: torch keeps only its C++ half for the default
    group (module docstring), which lives until the process ends.
    """
    _KEPT.append(store)
    return store
