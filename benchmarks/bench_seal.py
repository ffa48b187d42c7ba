"""What a payload's protection costs per byte: the choices for the transfer queue's data path.

    python benchmarks/bench_seal.py [--sizes 65536,1048576] [--seconds 2.0]

The queue's TCP path encrypts every frame with CURVE (libzmq's CurveZMQ: XSalsa20-Poly1305 per
message). The candidates for payload frames after a CURVE handshake (issue "a data plane for
omni-modal steps"): AES-256-GCM or ChaCha20-Poly1305 from `cryptography` (encrypt and
authenticate), or a MAC alone where the network is private (AES-GMAC, HMAC-SHA256, keyed
BLAKE2b). For each payload size it measures, on one core of this host and in the same run:

* `copy`: `bytearray(payload)`, a pass over the bytes that does nothing else;
* each primitive sealing the payload (the sender's work) and opening it (the receiver's: verify,
  and decrypt where it encrypts), each timed on its own;
* zmq over loopback TCP, one PUSH process to a PULL here, plain and with CURVE on (both
  processes' time: the sender encrypts while the receiver decrypts).

Each line gives GB/s of payload and, for the primitives, the slower of seal and open (the
pipeline's ceiling when the sender and the receiver each have a core, as the zmq runs do) as a
ratio to CURVE's end-to-end GB/s at that size, e.g.

    1 MiB  aes-256-gcm  seal 3.10 GB/s, open 3.40 GB/s:  4.0x CURVE end to end (0.78 GB/s)

Nothing here is a queue: what the transport, the copies and the server's relay add comes on top
(`bench_queue.py`).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable

import zmq
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

NONCE = os.urandom(12)  # one nonce is fine for a benchmark; never for real frames


def rate(fn: Callable[[], object], size: int, seconds: float) -> float:
    """GB/s of `size`-byte payloads that `fn` gets through in about `seconds` (after a warm-up)."""
    fn()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        count += 1
    return count * size / elapsed / 1e9


def primitives(payload: bytes) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """(seal, open) of `payload` for each candidate: the sender's and the receiver's work."""
    key = os.urandom(32)
    aes, chacha = AESGCM(key), ChaCha20Poly1305(key)
    aes_sealed, chacha_sealed = aes.encrypt(NONCE, payload, None), chacha.encrypt(NONCE, payload, None)
    gmac_tag = aes.encrypt(NONCE, b"", payload)
    sha_tag = hmac.digest(key, payload, "sha256")
    blake_tag = hashlib.blake2b(payload, key=key, digest_size=32).digest()

    def hmac_open() -> bool:
        return hmac.compare_digest(hmac.digest(key, payload, "sha256"), sha_tag)

    def blake_open() -> bool:
        return hmac.compare_digest(hashlib.blake2b(payload, key=key, digest_size=32).digest(), blake_tag)

    return {
        "copy": (lambda: bytearray(payload), lambda: bytearray(payload)),
        "aes-256-gcm": (lambda: aes.encrypt(NONCE, payload, None), lambda: aes.decrypt(NONCE, aes_sealed, None)),
        # AES-GCM with the payload as associated data only: a tag (GMAC), nothing encrypted
        "aes-gmac": (lambda: aes.encrypt(NONCE, b"", payload), lambda: aes.decrypt(NONCE, gmac_tag, payload)),
        "chacha20-poly1305": (lambda: chacha.encrypt(NONCE, payload, None),
                              lambda: chacha.decrypt(NONCE, chacha_sealed, None)),
        "hmac-sha256": (lambda: hmac.digest(key, payload, "sha256"), hmac_open),
        "blake2b-keyed": (lambda: hashlib.blake2b(payload, key=key, digest_size=32).digest(), blake_open),
    }


def _push(address: str, size: int, count: int, curve: tuple[bytes, bytes, bytes] | None) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    if curve is not None:
        server_public, public, secret = curve
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret
    sock.connect(address)
    payload = os.urandom(size)
    for _ in range(count):
        sock.send(payload, copy=False)
    sock.close(linger=-1)
    ctx.term()


def zmq_rate(size: int, seconds: float, curve: bool) -> float:
    """GB/s of `size`-byte messages from a PUSH process to a PULL here over loopback TCP."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    keys = None
    if curve:
        server_public, server_secret = zmq.curve_keypair()
        pull.curve_server, pull.curve_secretkey = True, server_secret
        keys = (server_public, *zmq.curve_keypair())
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    count = max(64, int(seconds * 2e9 / size))  # about `seconds` at 2 GB/s; CURVE takes longer
    sender = mp.get_context("spawn").Process(target=_push, args=(f"tcp://127.0.0.1:{port}", size, count, keys))
    sender.start()
    pull.recv(copy=False)  # the connection is up: time the rest
    start = time.perf_counter()
    for _ in range(count - 1):
        pull.recv(copy=False)
    elapsed = time.perf_counter() - start
    sender.join()
    pull.close()
    ctx.term()
    return (count - 1) * size / elapsed / 1e9


def label(size: int) -> str:
    return f"{size // 1048576} MiB" if size >= 1048576 else f"{size // 1024} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="65536,1048576", help="payload sizes in bytes, comma-separated")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    for size in sizes:
        plain, curve = zmq_rate(size, args.seconds, curve=False), zmq_rate(size, args.seconds, curve=True)
        print(f"{label(size):>7}  zmq tcp plain  {plain:.2f} GB/s; CURVE {curve:.2f} GB/s ({curve / plain:.2f}x plain)")
        for name, (seal, open_) in primitives(os.urandom(size)).items():
            sealing, opening = rate(seal, size, args.seconds), rate(open_, size, args.seconds)
            ceiling = min(sealing, opening)  # sender and receiver work at once, each on its own core
            print(f"{label(size):>7}  {name:<18} seal {sealing:6.2f} GB/s, open {opening:6.2f} GB/s: "
                  f"{ceiling / curve:5.1f}x CURVE end to end ({curve:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
