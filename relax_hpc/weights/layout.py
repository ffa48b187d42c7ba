"""The weight channel's wire layout: bucket planning, the JSON header, packing and unpacking.

Pure functions, no communication. A broadcast of `named_tensors` is described by one
`Header`: the version, a sequence number, the backend, and a list of `Bucket`s. A bucket is one
flat byte buffer that travels as one collective; each parameter in it starts at an offset
aligned to `ALIGN` bytes so the receiver can view the bytes as the parameter's dtype without a
copy. Buckets are byte buffers, so one bucket may hold parameters of several dtypes.

Two kinds of bucket:

* packed: small parameters copied back to back into a staging buffer, at most `bucket_bytes`;
* direct: one parameter of at least `direct_bytes` sent straight from its own storage (no copy
  on the sender). A parameter larger than `bucket_bytes` is always direct, so the receiver's
  buffer is bounded by `max(bucket_bytes, largest parameter)`.

The header is JSON (never pickle): it is read by processes that must not run code they receive.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch

ALIGN = 64  # bytes; covers every torch dtype's alignment (complex128 needs 16)
HEADER_FORMAT = 1


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its bucket."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    index: int
    nbytes: int
    direct: bool
    params: tuple[ParamSlot, ...]


@dataclass(frozen=True)
class Header:
    version: int
    seq: int
    backend: str
    buckets: tuple[Bucket, ...]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    @property
    def max_packed_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets if not b.direct), default=0)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight header names dtype '{name}', which this torch ({torch.__version__}) does not know")
    return dtype


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of `ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_buckets(
    named_tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int, direct_bytes: int
) -> tuple[Bucket, ...]:
    """Group parameters into buckets in their given order (the receiver applies them in that order).

    Packed buckets hold at most `bucket_bytes` (counting alignment padding); a parameter of at
    least `direct_bytes` bytes, or larger than `bucket_bytes`, gets a direct bucket of its own.
    """
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be at least {ALIGN} bytes (default 512 MiB)")
    names = [n for n, _ in named_tensors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"weight broadcast names parameter(s) {dup} more than once; names must be unique")
    buckets: list[Bucket] = []
    current: list[ParamSlot] = []
    used = 0

    def close_packed() -> None:
        nonlocal current, used
        if current:
            buckets.append(Bucket(len(buckets), used, False, tuple(current)))
        current, used = [], 0

    for name, t in named_tensors:
        nbytes = tensor_nbytes(t)
        slot = ParamSlot(name, dtype_name(t.dtype), tuple(t.shape), 0, nbytes)
        if nbytes >= direct_bytes or nbytes > bucket_bytes:
            close_packed()
            buckets.append(Bucket(len(buckets), nbytes, True, (slot,)))
            continue
        offset = aligned(used)
        if current and offset + nbytes > bucket_bytes:
            close_packed()
            offset = 0
        current.append(ParamSlot(name, slot.dtype, slot.shape, offset, nbytes))
        used = offset + nbytes
    close_packed()
    return tuple(buckets)


def encode_header(header: Header) -> bytes:
    doc: dict[str, Any] = {
        "format": HEADER_FORMAT,
        "version": header.version,
        "seq": header.seq,
        "backend": header.backend,
        "buckets": [
            {
                "nbytes": b.nbytes,
                "direct": b.direct,
                "params": [[p.name, p.dtype, list(p.shape), p.offset, p.nbytes] for p in b.params],
            }
            for b in header.buckets
        ],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_header(raw: bytes) -> Header:
    doc = json.loads(raw.decode())
    if doc.get("format") != HEADER_FORMAT:
        raise ValueError(
            f"weight header format {doc.get('format')!r}, this receiver reads format {HEADER_FORMAT}; "
            "run the same relax-hpc version on the trainer and the engines"
        )
    buckets = tuple(
        Bucket(
            i,
            int(b["nbytes"]),
            bool(b["direct"]),
            tuple(ParamSlot(str(n), str(d), tuple(int(x) for x in s), int(o), int(nb)) for n, d, s, o, nb in b["params"]),
        )
        for i, b in enumerate(doc["buckets"])
    )
    return Header(int(doc["version"]), int(doc["seq"]), str(doc["backend"]), buckets)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (no copy)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def pack_bucket(bucket: Bucket, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy a packed bucket's parameters into `out` (a uint8 buffer); returns the used prefix."""
    assert not bucket.direct and out.dtype == torch.uint8 and out.numel() >= bucket.nbytes
    for p in bucket.params:
        if p.nbytes:
            view_param(out, p).copy_(tensors[p.name])
    return out[: bucket.nbytes]


def view_param(buffer: torch.Tensor, p: ParamSlot) -> torch.Tensor:
    """The parameter `p` as a typed, shaped view into a uint8 bucket buffer (no copy)."""
    dtype = dtype_from_name(p.dtype)
    raw = buffer[p.offset : p.offset + p.nbytes]
    if p.nbytes == 0:
        return torch.empty(p.shape, dtype=dtype, device=buffer.device)
    return (raw if dtype == torch.uint8 else raw.view(dtype)).view(p.shape)


def unpack_bucket(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Named views into a received bucket; they are valid until the buffer is reused."""
    return [(p.name, view_param(buffer, p)) for p in bucket.params]
