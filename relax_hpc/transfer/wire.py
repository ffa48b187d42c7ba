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
column is checked against its frame lengths. This module is pure (no sockets, no files) so the
server, the client and the tests share it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from relax_hpc.transfer.queue import (
    MAX_NAME_LEN,
    MAX_STR_LEN,
    Row,
    Scalar,
    TransferQueueError,
    Value,
    check_name,
    check_value,
)
from relax_hpc.transfer.columns import ArrayColumn, ColumnRows

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
_ITEMSIZE = {
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
        return math.prod(self.shape) * _ITEMSIZE[self.kind][self.dtype]


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


# --------------------------------------------------------------------------- values -> columns
def _tag(value: Value) -> tuple[str, str]:
    if isinstance(value, torch.Tensor):
        return ("t", str(value.dtype).removeprefix("torch."))
    if isinstance(value, np.ndarray):
        return ("n", value.dtype.newbyteorder("=").name)
    return ("v", "")


def _tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _check_scalars(name: str, values: list[Any]) -> None:
    """An inline column (no arrays: a block never mixes them in): `check_value`'s rules, with
    floats, bools and None passed without the call."""
    for value in values:
        if type(value) in (float, bool, type(None)):
            continue
        check_value(name, value)


def _check_dtype(name: str, kind: str, dtype: str) -> None:
    table, library = (TORCH_DTYPES, "torch") if kind == "t" else (NUMPY_DTYPES, "numpy")
    if dtype not in table:
        raise TransferQueueError(f"field {name!r}: {library} dtype {dtype} cannot be queued; allowed: {sorted(table)}")


def _tensor_column(name: str, values: list[torch.Tensor], dtype: str) -> Column:
    _check_dtype(name, "t", dtype)
    for value in values:
        if value.device.type != "cpu" or value.layout != torch.strided or value.is_quantized:
            check_value(name, value)  # raises the dense-CPU message
    itemsize = _ITEMSIZE["t"][dtype]
    sizes = [v.numel() * itemsize for v in values]
    shapes = [list(v.shape) for v in values]
    if sum(sizes) >= JOIN_BELOW_BYTES * len(values):
        return Column("t", dtype, shapes, sizes, buffers=[_tensor_bytes(v) for v in values])
    with torch.no_grad():  # one concatenation in C instead of a buffer per row
        flat = torch.cat([v if v.dim() == 1 else v.reshape(-1) for v in values])
    return Column("t", dtype, shapes, sizes, buffers=[_tensor_bytes(flat)])


def _numpy_column(name: str, values: list[np.ndarray], dtype: str) -> Column:
    _check_dtype(name, "n", dtype)
    arrays = [v if v.dtype.isnative else v.astype(v.dtype.newbyteorder("=")) for v in values]
    sizes = [a.nbytes for a in arrays]
    shapes = [list(a.shape) for a in arrays]
    if sum(sizes) >= JOIN_BELOW_BYTES * len(arrays):
        buffers = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    else:
        buffers = [np.concatenate([a.reshape(-1) for a in arrays]).view(np.uint8)]
    return Column("n", dtype, shapes, sizes, buffers=buffers)


def _column(name: str, values: list[Any], tag: tuple[str, str]) -> Column:
    check_name("field", name)
    kind, dtype = tag
    if kind == "t":
        return _tensor_column(name, values, dtype)
    if kind == "n":
        return _numpy_column(name, values, dtype)
    _check_scalars(name, values)
    return Column("v", values=values)


def _uniform_block(rows: Sequence[Row]) -> Block | None:
    """All rows as one block, or None when their fields or kinds differ."""
    first = rows[0]
    names = list(first)
    if any(len(row) != len(names) for row in rows):
        return None
    columns: dict[str, Column] = {}
    for name in names:
        try:
            values = [row[name] for row in rows]
        except KeyError:
            return None
        tag = _tag(values[0])
        if tag[0] == "v":
            if any(isinstance(v, (torch.Tensor, np.ndarray)) for v in values):
                return None
        elif any(_tag(v) != tag for v in values):
            return None
        columns[name] = _column(name, values, tag)
    return Block(len(rows), columns)


def encode_blocks(rows: Sequence[Row]) -> list[Block]:
    """Validate ``rows`` and group them into blocks of columns (usually one block).

    Raises :class:`TransferQueueError` naming the field for a value the wire cannot carry.
    """
    if isinstance(rows, ColumnRows):  # checked when built: its columns go out as they are
        return [_column_rows_block(rows)] if len(rows) else []
    if isinstance(rows, Mapping):
        raise TransferQueueError("rows must be a sequence of dicts, got a single dict; wrap it in [...]")
    rows = list(rows)
    for row in rows:
        if not isinstance(row, Mapping):
            raise TransferQueueError(f"each row must be a dict of field -> value, got {type(row).__name__}")
    if not rows:
        return []
    block = _uniform_block(rows)
    if block is not None:
        return [block]
    blocks: list[Block] = []  # rows of different shapes: one block per run of alike rows
    start = 0
    signature = [tuple((name, _tag(v)) for name, v in row.items()) for row in rows]
    for end in range(1, len(rows) + 1):
        if end == len(rows) or signature[end] != signature[start]:
            run = _uniform_block(rows[start:end])
            assert run is not None  # alike rows always form a block
            blocks.append(run)
            start = end
    return blocks


def _column_rows_block(rows: ColumnRows) -> Block:
    columns: dict[str, Column] = {}
    for name, column in rows.columns.items():
        if isinstance(column, ArrayColumn):
            columns[name] = _array_column(name, column)
        else:
            columns[name] = Column("v", values=column)
    return Block(len(rows), columns)


def _array_column(name: str, column: ArrayColumn) -> Column:
    data = column.data
    kind, dtype = _tag(data)
    _check_dtype(name, kind, dtype)
    if isinstance(data, torch.Tensor):
        buffer = _tensor_bytes(data)
    else:
        native = data if data.dtype.isnative else data.astype(data.dtype.newbyteorder("="))
        buffer = native.view(np.uint8)
    itemsize = _ITEMSIZE[kind][dtype]
    return Column(kind, dtype, [list(s) for s in column.shapes], [n * itemsize for n in column.numels],
                  buffers=[buffer])


def blocks_to_wire(
    blocks: Sequence[Block], frames: list[Buffer], shm: tuple[str, Sequence[int]] | None = None
) -> list[dict[str, Any]]:
    """Descriptors for ``blocks``; array buffers are appended to ``frames``, or, with
    ``shm = (file, offsets)``, were written to that file at those offsets (in buffer order)."""
    offsets = iter(shm[1]) if shm is not None else None
    out: list[dict[str, Any]] = []
    for block in blocks:
        cols: dict[str, Descriptor] = {}
        for name, col in block.columns.items():
            if col.kind == "v":
                cols[name] = ["v", col.values]
            elif shm is not None and offsets is not None:
                if len(col.buffers) == 1:
                    base = next(offsets)
                    starts = _starts(col.sizes, base)
                else:
                    starts = [next(offsets) for _ in col.buffers]
                cols[name] = ["s", col.kind, col.dtype, col.shapes, shm[0], starts]
            elif len(col.buffers) == 1:
                cols[name] = [col.kind, col.dtype, col.shapes, len(frames)]
                frames.append(col.buffers[0])
            else:
                cols[name] = [col.kind, col.dtype, col.shapes, list(range(len(frames), len(frames) + len(col.buffers)))]
                frames.extend(col.buffers)
        out.append({"n": block.rows, "cols": cols})
    return out


def array_buffers(blocks: Sequence[Block]) -> list[Buffer]:
    """Every array buffer of ``blocks`` in the order :func:`blocks_to_wire` consumes offsets."""
    return [buf for block in blocks for col in block.columns.values() if col.kind != "v" for buf in col.buffers]


def column_views(buf: Buffer, sizes: Sequence[int]) -> list[Buffer]:
    """Per-row views of a buffer holding rows of ``sizes`` bytes back to back (no copy)."""
    view = memoryview(buf).cast("B")
    return [view[start:start + size] for start, size in zip(_starts(sizes, 0), sizes)]


def _starts(sizes: Sequence[int], base: int) -> list[int]:
    starts, at = [], base
    for size in sizes:
        starts.append(at)
        at += size
    return starts


# --------------------------------------------------------------------------- stored rows -> wire
def stored_to_wire(rows: Sequence[EncodedRow], frames: list[Buffer]) -> list[dict[str, Any]]:
    """Descriptors for rows the server holds (a get reply): columns again, small rows' bytes
    joined into one frame per column, large rows' frames and shm references passed through."""
    out: list[dict[str, Any]] = []
    for run in _alike_runs(rows):
        cols: dict[str, Descriptor] = {}
        for name in run[0]:
            col = [row[name] for row in run]
            first = col[0]
            if first.kind == "v":
                cols[name] = ["v", [e.value for e in col]]
                continue
            shapes = [e.shape for e in col]
            if first.file:
                files = [e.file for e in col]
                where: Any = first.file if files.count(first.file) == len(files) else files
                cols[name] = ["s", first.kind, first.dtype, shapes, where, [e.offset for e in col]]
                continue
            pieces = [e.frame for e in col]
            if sum(memoryview(p).nbytes for p in pieces) >= JOIN_BELOW_BYTES * len(pieces):
                cols[name] = [first.kind, first.dtype, shapes, list(range(len(frames), len(frames) + len(pieces)))]
                frames.extend(pieces)
            else:
                cols[name] = [first.kind, first.dtype, shapes, len(frames)]
                frames.append(b"".join(pieces))
        out.append({"n": len(run), "cols": cols})
    return out


def _alike(rows: Sequence[EncodedRow]) -> bool:
    """Whether every row has the first row's fields with the same kind, dtype and storage."""
    names = list(rows[0])
    if any(len(row) != len(names) for row in rows):
        return False
    for name in names:
        first = rows[0][name]
        kind, dtype, in_file = first.kind, first.dtype, bool(first.file)
        try:
            if not all(e.kind == kind and e.dtype == dtype and bool(e.file) == in_file
                       for e in [row[name] for row in rows]):
                return False
        except KeyError:
            return False
    return True


def _alike_runs(rows: Sequence[EncodedRow]) -> list[Sequence[EncodedRow]]:
    if not rows:
        return []
    if _alike(rows):
        return [rows]
    # rows of several shapes (a get of all fields): runs of rows with the same signature
    signatures = [tuple((name, e.kind, e.dtype, bool(e.file)) for name, e in row.items()) for row in rows]
    runs, start = [], 0
    for end in range(1, len(rows) + 1):
        if end == len(rows) or signatures[end] != signatures[start]:
            runs.append(rows[start:end])
            start = end
    return runs


# --------------------------------------------------------------------------- wire -> columns
@dataclass(frozen=True)
class ArraySpec:
    """A validated array column: where each row's bytes are."""

    kind: str
    dtype: str
    shapes: list[list[int]]
    sizes: list[int]
    frames: list[int] | None = None  # one frame per row
    frame: int | None = None  # or every row back to back in one frame
    files: list[str] | None = None  # or shm: file and offset per row
    offsets: list[int] | None = None

    @property
    def frame_indices(self) -> list[int]:
        """The frames holding this column's bytes (none for shm)."""
        if self.frames is not None:
            return self.frames
        return [] if self.frame is None else [self.frame]


def _check_shapes(name: str, shapes: Any, n: int) -> list[list[int]]:
    """``n`` shapes, each a list of at most MAX_DIMS ints in 0..2**62 (kept as lists)."""
    if not isinstance(shapes, list) or len(shapes) != n:
        raise WireError(f"field {name!r}: shapes must be a list of {n} shapes")
    if not all(type(s) is list and len(s) <= MAX_DIMS for s in shapes):
        raise WireError(f"field {name!r}: each shape must be a list of at most {MAX_DIMS} ints")
    dims = [d for s in shapes for d in s]
    # type() and not isinstance(): True is not a dimension
    if not all(type(d) is int for d in dims) or (dims and not 0 <= min(dims) <= max(dims) < 2**62):
        bad = next(s for s in shapes if not all(type(d) is int and 0 <= d < 2**62 for d in s))
        raise WireError(f"field {name!r}: shape {bad!r} must hold non-negative ints")
    return shapes


_PLAIN_SCALARS = frozenset((int, float, bool, type(None)))


def _check_inline(name: str, values: list[Any]) -> list[Scalar]:
    """Inline values as msgpack decoded them: plain scalars and strings of at most MAX_STR_LEN."""
    if all(type(v) in _PLAIN_SCALARS for v in values):  # msgpack ints always fit in 64 bits
        return values
    for value in values:
        if type(value) in _PLAIN_SCALARS or (type(value) is str and len(value) <= MAX_STR_LEN):
            continue
        raise WireError(f"field {name!r}: inline value of type {type(value).__name__} is not allowed")
    return values


def _int_list(name: str, what: str, values: Any, n: int) -> list[int]:
    if not isinstance(values, list) or len(values) != n:
        raise WireError(f"field {name!r}: {what} must be a list of {n} ints")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in values):
        raise WireError(f"field {name!r}: {what} must hold ints >= 0")
    return values


def parse_column(name: str, desc: Any, n: int, frames: Sequence[Buffer]) -> list[Scalar] | ArraySpec:
    """Validate one column descriptor of ``n`` rows against the frames of its message."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
        raise WireError(f"field name {name!r} must be a str of 1..{MAX_NAME_LEN} characters")
    if not isinstance(desc, list) or not desc or desc[0] not in ("t", "n", "v", "s"):
        raise WireError(
            f"field {name!r}: column must be ['v', values], ['t'|'n', dtype, shapes, frame(s)] or "
            "['s', 't'|'n', dtype, shapes, file(s), offsets]"
        )
    if desc[0] == "v":
        if len(desc) != 2 or not isinstance(desc[1], list) or len(desc[1]) != n:
            raise WireError(f"field {name!r}: inline column must be ['v', [{n} values]]")
        return _check_inline(name, desc[1])
    shm = desc[0] == "s"
    if len(desc) != (6 if shm else 4):
        raise WireError(
            f"field {name!r}: "
            + ("shm column must be ['s', 't'|'n', dtype, shapes, file(s), offsets]" if shm
               else "array column must be [kind, dtype, shapes, frame(s)]")
        )
    kind, dtype, raw_shapes = (desc[1], desc[2], desc[3]) if shm else (desc[0], desc[1], desc[2])
    if kind not in ("t", "n"):
        raise WireError(f"field {name!r}: array kind must be 't' or 'n', got {kind!r}")
    table = _ITEMSIZE[kind]
    if not isinstance(dtype, str) or dtype not in table:
        raise WireError(f"field {name!r}: dtype {dtype!r} is not one of {sorted(table)}")
    shapes = _check_shapes(name, raw_shapes, n)
    itemsize = table[dtype]
    sizes = [math.prod(s) * itemsize for s in shapes]
    if shm:
        return _parse_shm(name, kind, dtype, shapes, sizes, desc[4], desc[5])
    where = desc[3]
    if isinstance(where, list):
        indices = _int_list(name, "frame indices", where, n)
        for i, (k, size) in enumerate(zip(indices, sizes)):
            if k >= len(frames):
                raise WireError(f"field {name!r}: frame index {k} outside 0..{len(frames) - 1}")
            have = memoryview(frames[k]).nbytes
            if have != size:
                raise WireError(f"field {name!r} row {i}: {dtype}{list(shapes[i])} needs {size} bytes, frame {k} has {have}")
        return ArraySpec(kind, dtype, shapes, sizes, frames=indices)
    if not isinstance(where, int) or isinstance(where, bool) or not 0 <= where < len(frames):
        raise WireError(f"field {name!r}: frame index {where!r} outside 0..{len(frames) - 1}")
    have, want = memoryview(frames[where]).nbytes, sum(sizes)
    if have != want:
        raise WireError(f"field {name!r}: {n} rows of {dtype} need {want} bytes, frame {where} has {have}")
    return ArraySpec(kind, dtype, shapes, sizes, frame=where)


def _parse_shm(name: str, kind: str, dtype: str, shapes: list[list[int]], sizes: list[int],
               files: Any, offsets: Any) -> ArraySpec:
    n = len(shapes)
    names = [files] * n if isinstance(files, str) else files
    if not isinstance(names, list) or len(names) != n:
        raise WireError(f"field {name!r}: shm file must be a name or a list of {n} names")
    for file in set(names):
        if not isinstance(file, str) or not SHM_NAME.match(file):
            raise WireError(
                f"field {name!r}: shm file {file!r} must be a plain name of letters, digits, '-' and '_' "
                "(no '/', no '.') inside the server's shm directory"
            )
    if not isinstance(offsets, list) or len(offsets) != n:
        raise WireError(f"field {name!r}: shm offsets must be a list of {n} ints >= 0")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in offsets):
        raise WireError(f"field {name!r}: shm offset must be an int >= 0, got {offsets!r}"[:300])
    return ArraySpec(kind, dtype, shapes, sizes, files=names, offsets=offsets)


def _block_columns(descs: Any) -> list[tuple[int, dict[str, Any]]]:
    if not isinstance(descs, list):
        raise WireError("'blocks' must be a list of {'n': rows, 'cols': {field: column}}")
    out = []
    for block in descs:
        if not isinstance(block, dict) or set(block) != {"n", "cols"}:
            raise WireError("each block must be a map with exactly 'n' and 'cols'")
        n, cols = block["n"], block["cols"]
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_BLOCK_ROWS:
            raise WireError(f"block 'n' must be an int in 0..{MAX_BLOCK_ROWS}, got {n!r}")
        if not isinstance(cols, dict) or len(cols) > MAX_FIELDS:
            raise WireError(f"block 'cols' must be a map field -> column of at most {MAX_FIELDS} fields")
        out.append((n, cols))
    return out


def block_sizes(descs: Any) -> tuple[int, int]:
    """(rows, field values) that ``descs`` claim, from the header alone: nothing is built."""
    rows = values = 0
    for n, cols in _block_columns(descs):
        rows += n
        values += n * len(cols)
    return rows, values


def decode_blocks(descs: Any, frames: Sequence[Buffer]) -> list[EncodedRow]:
    """The server's view of a put/write: per-row references into the frames or shm files.

    Every column of a block is checked against the header and its frames before the block's
    rows are built, and each frame may be named once: a header cannot claim more rows, or more
    bytes, than the message carries.
    """
    rows: list[EncodedRow] = []
    named: set[int] = set()
    for n, cols in _block_columns(descs):
        specs = [(name, parse_column(name, desc, n, frames)) for name, desc in cols.items()]
        for name, spec in specs:
            _name_frames_once(name, spec, named)
        block: list[EncodedRow] = [{} for _ in range(n)]
        for name, spec in specs:
            for row, enc in zip(block, _encoded(spec, frames)):
                row[name] = enc
        rows.extend(block)
    return rows


def _name_frames_once(name: str, spec: list[Scalar] | ArraySpec, named: set[int]) -> None:
    if isinstance(spec, list):
        return
    for k in spec.frame_indices:
        if k in named:
            raise WireError(f"field {name!r}: frame {k} is named twice; each buffer belongs to one column and row")
        named.add(k)


def _encoded(spec: list[Scalar] | ArraySpec, frames: Sequence[Buffer]) -> list[Encoded]:
    if isinstance(spec, list):
        return [Encoded("v", value=v) for v in spec]
    kind, dtype = spec.kind, spec.dtype
    if spec.files is not None and spec.offsets is not None:
        return [Encoded(kind, dtype, shape, None, None, file, offset)
                for shape, file, offset in zip(spec.shapes, spec.files, spec.offsets)]
    if spec.frames is not None:
        return [Encoded(kind, dtype, shape, frames[k]) for shape, k in zip(spec.shapes, spec.frames)]
    assert spec.frame is not None
    pieces = column_views(frames[spec.frame], spec.sizes)
    return [Encoded(kind, dtype, shape, piece) for shape, piece in zip(spec.shapes, pieces)]


# --------------------------------------------------------------------------- wire -> values
ShmReader = Callable[[list[str], list[int], list[int]], Buffer]


def materialize_blocks(descs: Any, frames: Sequence[Buffer], read_shm: ShmReader | None = None) -> list[dict[str, Value]]:
    """Rows of a get reply as tensors / arrays / scalars.

    Rows of one column share one allocation (views of it); ``read_shm(files, offsets, sizes)``
    returns a writable buffer holding the rows' shm bytes back to back (a client without shm
    access passes None and refuses references).
    """
    rows: list[dict[str, Value]] = []
    for n, cols in _block_columns(descs):
        names, columns = [], []
        for name, desc in cols.items():
            spec = parse_column(name, desc, n, frames)
            names.append(name)
            columns.append(spec if isinstance(spec, list) else _arrays(name, spec, frames, read_shm))
        if not names:
            rows.extend({} for _ in range(n))
            continue
        rows.extend(dict(zip(names, values)) for values in zip(*columns))
    return rows


def _writable(buf: Buffer) -> Buffer:
    view = memoryview(buf)
    if view.readonly and view.nbytes:
        return bytearray(view)  # torch needs writable memory; copy only then
    return buf


def _arrays(name: str, spec: ArraySpec, frames: Sequence[Buffer], read_shm: ShmReader | None) -> list[Value]:
    if spec.files is not None and spec.offsets is not None:
        if read_shm is None:
            raise WireError(f"field {name!r}: shm reference received by a client that cannot read shm")
        return split_rows(spec, read_shm(spec.files, spec.offsets, spec.sizes))
    if spec.frames is not None:
        return [split_rows(ArraySpec(spec.kind, spec.dtype, [shape], [size]), _writable(frames[k]))[0]
                for shape, size, k in zip(spec.shapes, spec.sizes, spec.frames)]
    assert spec.frame is not None
    return split_rows(spec, _writable(frames[spec.frame]))


def split_rows(spec: ArraySpec, buf: Buffer) -> list[Value]:
    """Views of one buffer holding ``spec``'s rows back to back, shaped per row."""
    numels = [math.prod(s) for s in spec.shapes]
    if spec.kind == "n":
        flat = np.frombuffer(buf, dtype=NUMPY_DTYPES[spec.dtype]) if sum(numels) else np.empty(0, NUMPY_DTYPES[spec.dtype])
        cuts = np.cumsum(numels)[:-1] if numels else []
        return [piece.reshape(shape) for piece, shape in zip(np.split(flat, cuts), spec.shapes)]
    dtype = TORCH_DTYPES[spec.dtype]
    tensor = torch.frombuffer(buf, dtype=dtype) if sum(numels) else torch.empty(0, dtype=dtype)
    pieces = torch.split(tensor, numels)
    return [p if len(shape) == 1 else p.view(shape) for p, shape in zip(pieces, spec.shapes)]


def shm_files(rows: Sequence[EncodedRow]) -> set[str]:
    """The shm payload files that ``rows`` reference."""
    return {enc.file for row in rows for enc in row.values() if enc.file}
