"""Sealed messages of the transfer queue: each frame under AES-256-GCM with a per-session key.

CURVE encrypts every byte at about 0.8 GB/s end to end on a 2-core host; AES-256-GCM seals at
about 7 GB/s per core and AES-GMAC tags at about 25 GB/s (benchmarks/bench_seal.py,
docs/transfer-queue.md, "Authentication"). So a session's CURVE handshake only hands out its
key (the ping reply, encrypted by CURVE, carries it), and from then on the session's messages,
control and payload alike, travel on a plain socket as sealed messages:

    [prefix, body...]     prefix = MAGIC | mode | key id (16) | counter (8) | frame count (4)

- ``encrypt``: each body frame is that frame's AES-256-GCM ciphertext and tag, the prefix its
  associated data;
- ``authenticate``: the frames travel as they are, after one frame of tags: a GMAC of each frame
  and one of the prefix (the site's network is private, integrity is what it needs).

A frame's nonce is direction | frame index | counter, never used twice under one key: the
counter of each direction rises with every message, and the receiver refuses a counter that
is not above the last it accepted (a replayed or reordered message), a message whose frame
count differs from its prefix (frames dropped or added), and every frame whose tag does not
verify. Pure functions of bytes and a key: no socket here.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

PayloadMode = Literal["curve", "encrypt", "authenticate"]
SEALED_MODES: tuple[str, ...] = ("encrypt", "authenticate")

MAGIC = b"RTQ1"
_MODE_BYTE = {"encrypt": b"E", "authenticate": b"A"}
_PREFIX = struct.Struct(">4sc16sQI")  # magic, mode, key id, counter, frame count
PREFIX_BYTES = _PREFIX.size
KEY_ID_BYTES = 16
TAG_BYTES = 16
MAX_FRAMES = (1 << 24) - 2  # frame indices are 3 bytes; the last index is the prefix's tag
_PREFIX_INDEX = (1 << 24) - 1

TO_SERVER, TO_CLIENT = 0, 1  # the nonce's direction byte: a reply can never pass for a request


class SealError(Exception):
    """A message that is not a sealed message of this session, or not the next one."""


def new_session_key() -> tuple[bytes, bytes]:
    """A fresh (key id, 256-bit key) for one session."""
    return os.urandom(KEY_ID_BYTES), AESGCM.generate_key(256)


def key_id_of(message: Sequence[Any]) -> bytes | None:
    """The key id a message names in its prefix; None when it is no sealed message."""
    if not message:
        return None
    head = memoryview(message[0])
    if head.nbytes != PREFIX_BYTES or bytes(head[:4]) != MAGIC:
        return None
    return bytes(head[5:5 + KEY_ID_BYTES])


def _nonce(direction: int, index: int, counter: int) -> bytes:
    return bytes((direction,)) + index.to_bytes(3, "big") + counter.to_bytes(8, "big")


class Sealer:
    """One session's key in one process: seals what it sends in ``send_direction`` and opens
    what comes the other way, each direction's counter rising. Not thread-safe."""

    def __init__(self, key_id: bytes, key: bytes, mode: str, send_direction: int) -> None:
        if mode not in SEALED_MODES:
            raise ValueError(f"payload mode {mode!r} seals nothing; expected one of {SEALED_MODES}")
        if len(key_id) != KEY_ID_BYTES or len(key) != 32:
            raise ValueError(f"need a {KEY_ID_BYTES}-byte key id and a 32-byte key; got {len(key_id)} and {len(key)}")
        self.key_id = key_id
        self.mode = mode
        self._aead = AESGCM(key)
        self._out_dir = send_direction
        self._in_dir = 1 - send_direction
        self._sent = 0  # the counter of the last message sealed
        self._opened = 0  # the counter of the last message accepted

    @property
    def opened(self) -> int:
        """How many messages of the other side this end has accepted (the last counter)."""
        return self._opened

    def seal(self, frames: Sequence[Any]) -> list[Any]:
        """``[prefix, body...]`` of ``frames`` (buffers), with the next counter."""
        if len(frames) > MAX_FRAMES:
            raise ValueError(f"a sealed message holds at most {MAX_FRAMES} frames; got {len(frames)}")
        self._sent += 1
        counter = self._sent
        prefix = _PREFIX.pack(MAGIC, _MODE_BYTE[self.mode], self.key_id, counter, len(frames))
        aead, out = self._aead, self._out_dir
        if self.mode == "encrypt":
            return [prefix, *(aead.encrypt(_nonce(out, i, counter), f, prefix) for i, f in enumerate(frames))]
        tags = b"".join(aead.encrypt(_nonce(out, i, counter), b"", f) for i, f in enumerate(frames))
        tags += aead.encrypt(_nonce(out, _PREFIX_INDEX, counter), b"", prefix)
        return [prefix, tags, *frames]

    def open(self, message: Sequence[Any]) -> list[Any]:
        """The frames of a sealed ``message`` (buffers or zmq frames); raises :class:`SealError`
        unless it is this session's next message, whole and unaltered. Encrypted frames come back
        as writable arrays, authenticated ones as the received buffers."""
        if not message:
            raise SealError("empty message")
        prefix = bytes(memoryview(message[0]))
        if len(prefix) != PREFIX_BYTES:
            raise SealError(f"prefix of {len(prefix)} bytes; expected {PREFIX_BYTES}")
        magic, mode, key_id, counter, count = _PREFIX.unpack(prefix)
        if magic != MAGIC or key_id != self.key_id:
            raise SealError("not a sealed message of this session")
        if mode != _MODE_BYTE[self.mode]:
            raise SealError(f"sealed as {mode!r}, this session uses {self.mode!r}")
        if counter <= self._opened:
            raise SealError(f"message {counter} arrived after message {self._opened}: replayed or reordered")
        body = [memoryview(f) for f in message[1:]]
        try:
            frames = self._open_encrypted(body, prefix, counter, count) if self.mode == "encrypt" else (
                self._open_authenticated(body, prefix, counter, count))
        except InvalidTag:
            raise SealError(f"message {counter} does not verify: altered, or sealed with another key") from None
        self._opened = counter
        return frames

    def _open_encrypted(self, body: list[memoryview], prefix: bytes, counter: int, count: int) -> list[Any]:
        if len(body) != count:
            raise SealError(f"message {counter} has {len(body)} frames; its prefix says {count}")
        frames = []
        for i, sealed in enumerate(body):
            if sealed.nbytes < TAG_BYTES:
                raise SealError(f"frame {i} of message {counter} is shorter than its tag")
            plain = np.empty(sealed.nbytes - TAG_BYTES, dtype=np.uint8)  # writable, not zeroed
            self._aead.decrypt_into(_nonce(self._in_dir, i, counter), sealed, prefix, memoryview(plain))
            frames.append(plain)
        return frames

    def _open_authenticated(self, body: list[memoryview], prefix: bytes, counter: int, count: int) -> list[Any]:
        if len(body) != count + 1 or body[0].nbytes != (count + 1) * TAG_BYTES:
            raise SealError(f"message {counter} does not hold the {count} frames and tags its prefix says")
        tags, frames = body[0], body[1:]
        aead, into = self._aead, self._in_dir
        aead.decrypt(_nonce(into, _PREFIX_INDEX, counter), tags[count * TAG_BYTES:], prefix)
        for i, frame in enumerate(frames):
            aead.decrypt(_nonce(into, i, counter), tags[i * TAG_BYTES:(i + 1) * TAG_BYTES], frame)
        return frames
