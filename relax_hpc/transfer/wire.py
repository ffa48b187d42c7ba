"""Wire format of the ZMQ transfer queue: a msgpack header plus raw tensor buffers as frames.

A message is ``[header, buf_0, buf_1, ...]``. The header is a msgpack map (``op``, request
``id``, session, partition, ...); rows inside it are maps ``field -> descriptor`` where a
descriptor is one of::

    ["t", "<torch dtype>", [shape...], k]   torch tensor, bytes in frame buf_k
    ["n", "<numpy dtype>", [shape...], k]   numpy array, bytes in frame buf_k
    ["v", value]                            None / bool / int / float / str, inline
    ["s", "t"|"n", dtype, [shape...], file, offset]
                                            same-host shared memory: the bytes are at
                                            ``offset`` of ``file`` in the server's shm directory

Buffers are sent zero-copy (a memoryview of the contiguous CPU data) and received zero-copy
(tensors are built on the received frame). Nothing is unpickled: msgpack decodes plain data,
dtypes come from an allowlist, and every descriptor is checked against its frame length.
This module is pure (no sockets) so the server, the client and the tests share it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from relax_hpc.transfer.queue import MAX_NAME_LEN, MAX_STR_LEN, Row, Scalar, Value

WIRE_VERSION = 1
MAX_DIMS = 32
MAX_HEADER_BYTES = 64 * 1024 * 1024
# A shared-memory payload file is named by a plain word: no "/", no ".", so a reference can
# never leave the server's shm directory nor name a temporary (dot-prefixed) file.
SHM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")

# Anything exposing the buffer protocol: bytes, memoryview, numpy arrays, zmq.Frame.
Buffer = Any

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


class WireError(ValueError):
    """A message that does not follow the wire format (answered with an 'invalid' error)."""


@dataclass(frozen=True)
class Encoded:
    """One field as carried on the wire; the server stores these without decoding them."""

    kind: str  # "t", "n" or "v"
    dtype: str = ""
    shape: tuple[int, ...] = ()
    frame: Buffer = None
    value: Scalar = None
    file: str = ""  # non-empty: the bytes live in this shm payload file, not in ``frame``
    offset: int = 0

    @property
    def nbytes(self) -> int:
        table: Mapping[str, Any] = TORCH_DTYPES if self.kind == "t" else NUMPY_DTYPES
        return math.prod(self.shape) * table[self.dtype].itemsize


EncodedRow = dict[str, Encoded]
Descriptor = list[Any]


# --------------------------------------------------------------------------- headers
def pack_header(header: Mapping[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(frame: Buffer) -> dict[str, Any]:
    """Decode and sanity-check a header frame (plain msgpack data only)."""
    data = memoryview(frame)
    if data.nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header of {data.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
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


# --------------------------------------------------------------------------- values -> wire
def _tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def encode_value(value: Value) -> Encoded:
    """Turn a queued value into its wire form; buffers alias the caller's memory."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in TORCH_DTYPES:
            raise WireError(f"torch dtype {value.dtype} cannot be queued; allowed: {sorted(TORCH_DTYPES)}")
        return Encoded("t", dtype, tuple(value.shape), _tensor_bytes(value))
    if isinstance(value, np.ndarray):
        array = value if value.dtype.isnative else value.astype(value.dtype.newbyteorder("="))
        if array.dtype.name not in NUMPY_DTYPES:
            raise WireError(f"numpy dtype {value.dtype} cannot be queued; allowed: {sorted(NUMPY_DTYPES)}")
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        return Encoded("n", array.dtype.name, tuple(array.shape), data)
    return Encoded("v", value=value)


def encode_rows(rows: Sequence[Mapping[str, Encoded]], frames: list[Buffer]) -> list[dict[str, Descriptor]]:
    """Descriptors for ``rows``; their buffers are appended to ``frames`` (indices relative to it)."""
    out: list[dict[str, Descriptor]] = []
    for row in rows:
        desc: dict[str, Descriptor] = {}
        for name, enc in row.items():
            if enc.kind == "v":
                desc[name] = ["v", enc.value]
            elif enc.file:
                desc[name] = ["s", enc.kind, enc.dtype, list(enc.shape), enc.file, enc.offset]
            else:
                desc[name] = [enc.kind, enc.dtype, list(enc.shape), len(frames)]
                frames.append(enc.frame)
        out.append(desc)
    return out


def encode_value_rows(rows: Sequence[Row]) -> list[EncodedRow]:
    return [{name: encode_value(v) for name, v in row.items()} for row in rows]


# --------------------------------------------------------------------------- wire -> values
def _check_shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise WireError(f"field {name!r}: shape must be a list of at most {MAX_DIMS} ints")
    if not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**62 for s in shape):
        raise WireError(f"field {name!r}: shape {shape!r} must hold non-negative ints")
    return tuple(shape)


def _check_scalar(name: str, value: Any) -> Scalar:
    if value is None or isinstance(value, (bool, int, float)):
        return value  # type: ignore[no-any-return]
    if isinstance(value, str) and len(value) <= MAX_STR_LEN:
        return value
    raise WireError(f"field {name!r}: inline value of type {type(value).__name__} is not allowed")


def decode_descriptor(name: str, desc: Any, frames: Sequence[Buffer]) -> Encoded:
    """Validate one descriptor against the frames of its message."""
    if not isinstance(desc, list) or not desc or desc[0] not in ("t", "n", "v", "s"):
        raise WireError(
            f"field {name!r}: descriptor must be ['t'|'n', dtype, shape, frame], ['v', value] or "
            "['s', 't'|'n', dtype, shape, file, offset]"
        )
    if desc[0] == "s":
        return _decode_shm_ref(name, desc)
    if desc[0] == "v":
        if len(desc) != 2:
            raise WireError(f"field {name!r}: inline descriptor must be ['v', value]")
        return Encoded("v", value=_check_scalar(name, desc[1]))
    if len(desc) != 4:
        raise WireError(f"field {name!r}: array descriptor must be [kind, dtype, shape, frame]")
    kind, dtype, shape_raw, index = desc
    table: Mapping[str, Any] = TORCH_DTYPES if kind == "t" else NUMPY_DTYPES
    if not isinstance(dtype, str) or dtype not in table:
        raise WireError(f"field {name!r}: dtype {dtype!r} is not one of {sorted(table)}")
    shape = _check_shape(name, shape_raw)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(frames):
        raise WireError(f"field {name!r}: frame index {index!r} outside 0..{len(frames) - 1}")
    itemsize = table[dtype].itemsize
    want = math.prod(shape) * itemsize
    have = memoryview(frames[index]).nbytes
    if want != have:
        raise WireError(f"field {name!r}: {dtype}{list(shape)} needs {want} bytes, frame {index} has {have}")
    return Encoded(kind, dtype, shape, frames[index])


def _decode_shm_ref(name: str, desc: list[Any]) -> Encoded:
    """A shared-memory reference; the file itself is checked by whoever opens it."""
    if len(desc) != 6 or desc[1] not in ("t", "n"):
        raise WireError(f"field {name!r}: shm descriptor must be ['s', 't'|'n', dtype, shape, file, offset]")
    _, kind, dtype, shape_raw, file, offset = desc
    table: Mapping[str, Any] = TORCH_DTYPES if kind == "t" else NUMPY_DTYPES
    if not isinstance(dtype, str) or dtype not in table:
        raise WireError(f"field {name!r}: dtype {dtype!r} is not one of {sorted(table)}")
    shape = _check_shape(name, shape_raw)
    if not isinstance(file, str) or not SHM_NAME.match(file):
        raise WireError(
            f"field {name!r}: shm file {file!r} must be a plain name of letters, digits, '-' and '_' "
            "(no '/', no '.') inside the server's shm directory"
        )
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < 2**62:
        raise WireError(f"field {name!r}: shm offset {offset!r} must be an int >= 0")
    return Encoded(kind, dtype, shape, None, None, file, offset)


def shm_files(rows: Sequence[EncodedRow]) -> set[str]:
    """The shm payload files that ``rows`` reference."""
    return {enc.file for row in rows for enc in row.values() if enc.file}


def decode_rows(descs: Any, frames: Sequence[Buffer]) -> list[EncodedRow]:
    if not isinstance(descs, list):
        raise WireError("'rows' must be a list of maps field -> descriptor")
    rows: list[EncodedRow] = []
    for desc_row in descs:
        if not isinstance(desc_row, dict):
            raise WireError("each row must be a map field -> descriptor")
        row: EncodedRow = {}
        for name, desc in desc_row.items():
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
                raise WireError(f"field name {name!r} must be a str of 1..{MAX_NAME_LEN} characters")
            row[name] = decode_descriptor(name, desc, frames)
        rows.append(row)
    return rows


def materialize(enc: Encoded) -> Value:
    """Build the tensor / array / scalar for a received field, sharing the frame's memory."""
    if enc.kind == "v":
        return enc.value
    if enc.file:
        raise WireError(f"shm reference to {enc.file!r} must be read with relax_hpc.transfer.shm.read_rows")
    view = memoryview(enc.frame)
    if view.readonly and view.nbytes:
        view = memoryview(bytearray(view))  # torch needs writable memory; copy only then
    if enc.kind == "n":
        return np.frombuffer(view, dtype=NUMPY_DTYPES[enc.dtype]).reshape(enc.shape)
    dtype = TORCH_DTYPES[enc.dtype]
    if view.nbytes == 0:
        return torch.empty(enc.shape, dtype=dtype)
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(enc.shape)


def materialize_rows(rows: Sequence[EncodedRow]) -> list[dict[str, Value]]:
    return [{name: materialize(enc) for name, enc in row.items()} for row in rows]


