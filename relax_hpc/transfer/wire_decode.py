"""Rows off the wire (relax_hpc/transfer/wire.py has the format): every column descriptor is
checked against the header and the frames of its message before anything is built.

``decode_blocks`` is the server's view of a put or write (per-row references into the frames
or shm files, bytes left undecoded); ``materialize_blocks`` is the client's view of a get reply
(tensors, arrays and scalars built on the received frames); ``block_sizes`` counts what a header
claims without building anything. Nothing is unpickled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from relax_hpc.transfer.queue import MAX_NAME_LEN, MAX_STR_LEN, Scalar, Value
from relax_hpc.transfer.wire import (
    ITEMSIZE,
    MAX_BLOCK_ROWS,
    MAX_DIMS,
    MAX_FIELDS,
    NUMPY_DTYPES,
    SHM_NAME,
    TORCH_DTYPES,
    Buffer,
    Encoded,
    EncodedRow,
    WireError,
    column_views,
)


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
    table = ITEMSIZE[kind]
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
