"""What one request may cost the ZMQ transfer queue server, checked before it costs it.

The server runs inside the driver, so a message that makes it allocate far more than it
received (a put header claiming millions of rows with a few bytes of payload) or a frame
larger than its memory would take the training run down. The bounds, all refused with an
error reply naming the limit (docs/transfer-queue.md, "Limits"):

- a frame is at most ``max_frame_bytes`` (``zmq.MAXMSGSIZE``: libzmq drops the connection of
  a peer that sends a larger one before the server sees any of it);
- a request header is at most ``max_header_bytes`` (decoding msgpack costs up to ~70 bytes
  of Python objects per header byte);
- a put/write claims at most the queue's capacity in rows (``MAX_REQUEST_ROWS`` without one)
  and ``MAX_REQUEST_VALUES`` field values, counted from the header alone before any row is
  built (decoding costs ~0.3-0.5 KB per value, measured);
- every array's bytes are checked against the frame it names, each frame named once
  (:func:`relax_hpc.transfer.wire_decode.decode_blocks`).

Clients read ``max_frame_bytes`` and ``max_header_bytes`` from the ping reply and keep within
them (:func:`fit_frames`), so a legitimate put never trips the connection drop. Pure: no
sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relax_hpc.transfer.queue import TransferQueueError
from relax_hpc.transfer.wire import Block, column_views
from relax_hpc.transfer.wire_decode import block_sizes

DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024
# A rollout step of 16k rows of 11 fields has a header of about 1 MiB; 4 MiB bounds the cost
# of decoding a hostile one to about 290 MB (measured), near the size of the largest frame.
DEFAULT_MAX_HEADER_BYTES = 4 * 1024 * 1024
MAX_REQUEST_ROWS = 1 << 16
MAX_REQUEST_VALUES = 1 << 20
# ZMQ heartbeats: a peer that sends nothing (not even a heartbeat reply, which libzmq's I/O
# thread answers whatever Python is doing) for HEARTBEAT_TIMEOUT_S is disconnected, so a
# vanished host is noticed instead of being waited for forever.
HEARTBEAT_S = 5.0
HEARTBEAT_TIMEOUT_S = 30.0


def request_rows(descs: Any, max_rows: int | None) -> int:
    """The rows a put/write claims, from its header alone and before any row is built: at most
    ``max_rows`` rows (None: the caller checks) and ``MAX_REQUEST_VALUES`` values (rows x
    fields). Raises :class:`TransferQueueError` naming the limit; malformed blocks ``WireError``."""
    rows, values = block_sizes(descs)
    if max_rows is not None and rows > max_rows:
        raise TransferQueueError(
            f"a request of {rows} rows exceeds this queue's limit of {max_rows} rows per put/write "
            "(its capacity, or MAX_REQUEST_ROWS when it has none); put fewer rows per call"
        )
    if values > MAX_REQUEST_VALUES:
        raise TransferQueueError(
            f"a request of {values} field values (rows x fields) exceeds the limit of "
            f"{MAX_REQUEST_VALUES} per put/write; put fewer rows per call"
        )
    return rows


def fit_frames(blocks: Sequence[Block], max_frame: int) -> None:
    """Keep every buffer of ``blocks`` within the server's frame limit: a column whose rows were
    joined into one larger buffer goes back to one buffer (a view) per row. Raises
    :class:`TransferQueueError` for a single value larger than the limit."""
    for block in blocks:
        for name, col in block.columns.items():
            if col.kind == "v":
                continue
            if len(col.buffers) == 1 and len(col.sizes) > 1 and sum(col.sizes) > max_frame:
                col.buffers = column_views(col.buffers[0], col.sizes)
            for size in col.sizes:
                if size > max_frame:
                    raise TransferQueueError(
                        f"field {name!r}: a value of {size} bytes exceeds the queue server's frame "
                        f"limit of {max_frame} bytes; split it across rows, or start the server with "
                        "a larger max_frame_bytes"
                    )
