"""The sockets of sealed sessions (:mod:`relax_hpc.transfer.seal`) on both ends of the queue.

The server answers each request on the route it came by: the CURVE socket as it is
(:class:`PlainRoute`), or the plain data socket sealed with the key of the request's session
(:class:`SealedRoute`). It hands a session its key in the CURVE-encrypted ping reply
(:class:`SessionKeys`); the client then sends every request of that session through a
:class:`SealedDealer` on the data socket. A message on the data socket that names no key the
server handed out, or does not open under it, is dropped unread: only the job's processes,
which passed the CURVE handshake, hold a key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import zmq

from relax_hpc.transfer.seal import TO_CLIENT, SealError, Sealer, key_id_of, new_session_key


class PlainRoute:
    """Replies go out on ``sock`` (the CURVE socket) as they are."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock
        self.session: str | None = None  # any session may use the CURVE socket

    def send(self, identity: bytes, frames: Sequence[Any], copy: bool = False) -> None:
        self.sock.send_multipart([identity, *frames], copy=copy)


class SealedRoute:
    """Replies go out on ``sock`` (the data socket) sealed with the session's key."""

    def __init__(self, sock: zmq.Socket[Any], sealer: Sealer, session: str) -> None:
        self.sock = sock
        self.sealer = sealer
        self.session: str | None = session  # the only session whose requests this key may carry

    def send(self, identity: bytes, frames: Sequence[Any], copy: bool = False) -> None:
        self.sock.send_multipart([identity, *self.sealer.seal(frames)], copy=False)


Route = PlainRoute | SealedRoute


class SessionKeys:
    """The keys the server handed out, by key id, the oldest forgotten past ``limit``."""

    def __init__(self, mode: str, limit: int) -> None:
        self.mode = mode
        self._limit = limit
        self._keys: OrderedDict[bytes, tuple[Sealer, str]] = OrderedDict()

    def issue(self, session: str) -> dict[str, str]:
        """A new key for ``session``, as the ping reply carries it (hex)."""
        key_id, key = new_session_key()
        self._keys[key_id] = (Sealer(key_id, key, self.mode, send_direction=TO_CLIENT), session)
        while len(self._keys) > self._limit:
            self._keys.popitem(last=False)
        return {"mode": self.mode, "kid": key_id.hex(), "key": key.hex()}

    def open(self, message: Sequence[Any]) -> tuple[Sealer, str, list[Any]]:
        """(sealer, session, frames) of a sealed request; raises :class:`SealError`."""
        key_id = key_id_of(message)
        entry = self._keys.get(key_id) if key_id is not None else None
        if entry is None:
            raise SealError("names no key of this server")
        sealer, session = entry
        frames = sealer.open(message)
        self._keys.move_to_end(key_id)  # type: ignore[arg-type]
        return sealer, session, frames


class SealedDealer:
    """A client's DEALER on the data socket: what it sends is sealed, what it receives opened
    (:meth:`recv_multipart` raises :class:`SealError` for a message it cannot open, such as the
    server's unsealed probe of whether the client is still connected)."""

    def __init__(self, sock: zmq.Socket[Any], sealer: Sealer) -> None:
        self._sock = sock
        self._sealer = sealer

    def send_multipart(self, frames: Sequence[Any], copy: bool = False) -> None:
        self._sock.send_multipart(self._sealer.seal(frames), copy=False)

    def recv_multipart(self, copy: bool = False) -> list[Any]:
        return self._sealer.open(self._sock.recv_multipart(copy=False))

    def poll(self, timeout: float | None = None, flags: int = zmq.POLLIN) -> int:
        return self._sock.poll(timeout, flags)  # type: ignore[arg-type]  # zmq takes float ms too

    def close(self, linger: int | None = None) -> None:
        self._sock.close(linger)
