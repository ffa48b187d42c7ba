"""Wire format of the ZMQ transfer queue: a msgpack header plus raw array buffers as frames.

A message is ``[header, buf_0, buf_1, ...]``. The header is a msgpack map (``op``, request
``id``, session, partition, ...). Rows travel *by column*: ``blocks`` is a list of
``{"n": rows, "cols": {field: column}}``, every row of a block having the same fields with the
same kind and dtype, and a column is one of::

    ["v", [value, ...]]                          n inline None / bool / int / float / str
    ["t", "<torch dtype>", [shape, ...], k]      n tensors, their bytes back to back in frame k
    ["t", "<torch dtype>", [shape, ...], [k, ...]]   n tensors, one frame each (large rows)
    ["n", "<numpy dtype>", ...]                  the same for numpy arrays
    ["s", "t"|"n", dtype, [shape, ...], file | [file, ...], [offset, ...]]
                                                 same-host shared memory: row i's bytes are at
                                                 offset i of (its) file in the server's shm dir

One descriptor per field and call, not per field and row: a rollout step of 256 rows of 11
fields costs a handful of C-level concatenations and splits instead of ~3000 Python-level
descriptor checks (measured in docs/transfer-queue.md).

Buffers alias the caller's memory where possible and received tensors are built on the received
frame. Nothing is unpickled: msgpack decodes plain data, dtypes come from an allowlist, and every
column is checked against its frame lengths.

This module holds the format itself: its constants and dtype allowlists, the row and column
types, headers and their typed fields. ``wire_encode.py`` turns rows into descriptors and frames
(the client's puts, the server's get replies); ``wire_decode.py`` checks descriptors against
their frames and builds rows again (the server's view of a put, the client's of a reply). All
three are pure (no sockets, no files) so the server, the client and the tests share them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from relax_hpc.transfer.queue import MAX_NAME_LEN, Scalar

WIRE_VERSION = 2
MAX_DIMS = 32
# The largest header this process decodes by default (a client reading its server's replies);
# the server applies its own, smaller bound (relax_hpc/transfer/limits.py).
MAX_HEADER_BYTES = 64 * 1024 * 1024
MAX_BLOCK_ROWS = 1 << 24
MAX_FIELDS = 256  # per block: a row of the training loop has about a dozen
# Rows whose arrays average at least this many bytes keep a frame (or shm range) each: their
# per-row cost is small next to the copy that joining them into one buffer would add.
JOIN_BELOW_BYTES = 64 * 1024
# A shared-memory payload file is named by a plain word: no "/", no ".", so a reference can
# never leave the server's shm directory nor name a temporary (dot-prefixed) file.
SHM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")

# Anything exposing the buffer protocol: bytes, memoryview, numpy arrays, zmq.Frame.
Buffer = Any
Descriptor = list[Any]

TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.complex64, torch.complex128, torch.bool, torch.uint8, torch.int8,
        torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64,
    )
}
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name)
    for name in (
        "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}
ITEMSIZE = {
    "t": {name: d.itemsize for name, d in TORCH_DTYPES.items()},
    "n": {name: d.itemsize for name, d in NUMPY_DTYPES.items()},
}


class WireError(ValueError):
    """A message that does not follow the wire format (answered with an 'invalid' error)."""


class Encoded(NamedTuple):
    """One field of one row as the server stores it, without decoding the bytes."""

    kind: str  # "t", "n" or "v"
    dtype: str = ""
    shape: Sequence[int] = ()
    frame: Buffer = None
    value: Scalar = None
    file: str = ""  # non-empty: the bytes live in this shm payload file, not in ``frame``
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.kind][self.dtype]


EncodedRow = dict[str, Encoded]


@dataclass
class Column:
    """One field of a block of rows on its way out: inline values, or array bytes.

    ``buffers`` holds either one buffer with every row's bytes back to back, or one per row.
    """

    kind: str  # "v", "t" or "n"
    dtype: str = ""
    shapes: list[Any] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # bytes per row
    values: list[Scalar] = field(default_factory=list)
    buffers: list[Buffer] = field(default_factory=list)


@dataclass
class Block:
    rows: int
    columns: dict[str, Column]


# --------------------------------------------------------------------------- headers
def pack_header(header: Mapping[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(frame: Buffer, max_bytes: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    """Decode and sanity-check a header frame (plain msgpack data only)."""
    data = memoryview(frame)
    if data.nbytes > max_bytes:
        raise WireError(f"header of {data.nbytes} bytes exceeds the limit of {max_bytes}")
    try:
        header = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError(f"header is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(header, dict):
        raise WireError(f"header must be a msgpack map, got {type(header).__name__}")
    return header


def arg(header: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``header[key]`` checked against ``kind``; bool is never accepted as an int."""
    if key not in header:
        raise WireError(f"header field {key!r} is missing")
    value = header[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise WireError(f"header field {key!r} must be {kind}, got bool")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kinds):
        raise WireError(f"header field {key!r} must be {kind}, got {type(value).__name__}")
    return value


def name_arg(header: Mapping[str, Any], key: str) -> str:
    value = arg(header, key, str)
    if not value or len(value) > MAX_NAME_LEN:
        raise WireError(f"header field {key!r} must be a name of 1..{MAX_NAME_LEN} characters")
    return str(value)


def int_list_arg(header: Mapping[str, Any], key: str) -> list[int]:
    values = arg(header, key, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise WireError(f"header field {key!r} must be a list of ints")
    return values


def name_list_arg(header: Mapping[str, Any], key: str) -> list[str]:
    values = arg(header, key, list)
    if not all(isinstance(v, str) and 0 < len(v) <= MAX_NAME_LEN for v in values):
        raise WireError(f"header field {key!r} must be a list of names")
    return values


def column_views(buf: Buffer, sizes: Sequence[int]) -> list[Buffer]:
    """Per-row views of a buffer holding rows of ``sizes`` bytes back to back (no copy)."""
    view = memoryview(buf).cast("B")
    return [view[start:start + size] for start, size in zip(row_starts(sizes, 0), sizes)]


def row_starts(sizes: Sequence[int], base: int) -> list[int]:
    """Where each of rows of ``sizes`` bytes starts when they lie back to back from ``base``."""
    starts, at = [], base
    for size in sizes:
        starts.append(at)
        at += size
    return starts


def shm_files(rows: Sequence[EncodedRow]) -> set[str]:
    """The shm payload files that ``rows`` reference."""
    return {enc.file for row in rows for enc in row.values() if enc.file}
