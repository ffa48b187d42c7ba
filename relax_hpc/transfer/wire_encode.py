"""Rows onto the wire (relax_hpc/transfer/wire.py has the format): rows are checked and grouped
into blocks of columns, and the blocks become descriptors plus the frames (or shm ranges) that
hold their array bytes.

``encode_blocks`` and ``blocks_to_wire`` serve the client's puts; ``stored_to_wire`` serves the
server's get replies from the rows it holds, joining small rows' bytes into one frame per column.
Buffers alias the caller's memory where possible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from relax_hpc.transfer.columns import ArrayColumn, ColumnRows
from relax_hpc.transfer.queue import Row, TransferQueueError, Value, check_name, check_value
from relax_hpc.transfer.wire import (
    ITEMSIZE,
    JOIN_BELOW_BYTES,
    NUMPY_DTYPES,
    TORCH_DTYPES,
    Block,
    Buffer,
    Column,
    Descriptor,
    EncodedRow,
    row_starts,
)


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
    itemsize = ITEMSIZE["t"][dtype]
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
    itemsize = ITEMSIZE[kind][dtype]
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
                    starts = row_starts(col.sizes, base)
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
