"""Rows held by column: a step's rows built in bulk, put without a per-row pass on the way out.

A rollout step at hundreds of engines is tens of thousands of rows. Built one dict at a time
and then joined again column by column by the wire encoder, they cost the rollout process about
30 us of CPU a row, in the process that also drives the engines (benchmarks/bench_rows.py;
docs/benchmarks.md, "Fleet simulation"). `ColumnRows` keeps every field as one column: a list of scalars, or one flat
tensor or array holding every row's values back to back (`ArrayColumn`). It is a
``Sequence[Row]`` (indexing builds the row as a dict of views), so every queue accepts it; the
ZMQ client sends its columns as they are (`relax_hpc.transfer.wire_encode.encode_blocks`).

The columns are checked once, here: names, lengths, dtypes and the scalars' types, with the
same rules and messages as a row of dicts (`relax_hpc.transfer.queue.check_value`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union, overload

import numpy as np
import torch

from relax_hpc.transfer.queue import Scalar, TransferQueueError, Value, check_name, check_value

__all__ = ["ArrayColumn", "ColumnRows"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ArrayColumn:
    """One array field of n rows: ``data`` (1-D) holds the rows' values back to back, row i
    being the next ``prod(shapes[i])`` elements, shaped ``shapes[i]``."""

    data: Union[torch.Tensor, np.ndarray]
    shapes: list[Shape]

    @classmethod
    def of_lengths(cls, data: Union[torch.Tensor, np.ndarray], lengths: Sequence[int]) -> ArrayColumn:
        """1-D rows of ``lengths`` elements."""
        return cls(data, [(int(n),) for n in lengths])

    @classmethod
    def joined(cls, values: Sequence[Union[torch.Tensor, np.ndarray]]) -> ArrayColumn:
        """The column of per-row arrays (all tensors or all numpy arrays of one dtype), copied
        into one buffer."""
        if values and isinstance(values[0], torch.Tensor):
            with torch.no_grad():
                data: Any = torch.cat([v.reshape(-1) for v in values])
        else:
            data = np.concatenate([np.asarray(v).reshape(-1) for v in values]) if values else np.zeros(0)
        return cls(data, [tuple(v.shape) for v in values])

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]


Column = Union[list[Scalar], ArrayColumn]


class ColumnRows(Sequence[dict[str, Value]]):
    """``n`` rows with the same fields, each field one column (see the module docstring)."""

    def __init__(self, n: int, columns: Mapping[str, Column]) -> None:
        if n < 0:
            raise TransferQueueError(f"a ColumnRows holds n >= 0 rows, got {n}")
        self._n = n
        self._columns: dict[str, Column] = {}
        self._starts: dict[str, list[int]] = {}
        for name, column in columns.items():
            check_name("field", name)
            self._columns[name] = _checked(name, column, n)

    @property
    def columns(self) -> Mapping[str, Column]:
        return self._columns

    @property
    def fields(self) -> list[str]:
        return list(self._columns)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> dict[str, Value]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Value]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Value] | list[dict[str, Value]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._n))]
        if not -self._n <= index < self._n:
            raise IndexError(f"row {index} of {self._n}")
        i = index % self._n
        return {name: self._value(name, column, i) for name, column in self._columns.items()}

    def __iter__(self) -> Iterator[dict[str, Value]]:
        return (self[i] for i in range(self._n))

    def _value(self, name: str, column: Column, i: int) -> Value:
        if isinstance(column, list):
            return column[i]
        starts = self._starts.get(name)
        if starts is None:
            starts = self._starts[name] = [0, *np.cumsum(column.numels).tolist()]
        piece = column.data[starts[i]:starts[i + 1]]
        shape = column.shapes[i]
        return piece if len(shape) == 1 else piece.reshape(shape)


def _checked(name: str, column: Column, n: int) -> Column:
    if isinstance(column, ArrayColumn):
        _check_array(name, column, n)
        return column
    if not isinstance(column, list) or len(column) != n:
        raise TransferQueueError(f"field {name!r}: a column must be a list of {n} values or an ArrayColumn")
    types = set(map(type, column))
    if types <= _PLAIN:  # the usual column: one pass in C, and the ints' range from min and max
        if int in types:
            ints = column if types == {int} else [v for v in column if type(v) is int]
            check_value(name, min(ints))  # raises, naming the value, when it does not fit in 64 bits
            check_value(name, max(ints))
        return column
    for value in column:
        if isinstance(value, (torch.Tensor, np.ndarray)):
            raise TransferQueueError(f"field {name!r}: arrays go in an ArrayColumn, not a list column")
        check_value(name, value)
    return column


_PLAIN = frozenset((int, float, bool, type(None)))


def _check_array(name: str, column: ArrayColumn, n: int) -> None:
    data = column.data
    if len(column.shapes) != n:
        raise TransferQueueError(f"field {name!r}: {len(column.shapes)} row shapes for {n} rows")
    if not isinstance(data, (torch.Tensor, np.ndarray)) or data.ndim != 1:
        raise TransferQueueError(f"field {name!r}: an ArrayColumn's data must be a 1-D tensor or numpy array")
    check_value(name, data)  # dense CPU tensors, no object arrays
    if isinstance(data, torch.Tensor) and not data.is_contiguous():
        raise TransferQueueError(f"field {name!r}: an ArrayColumn's tensor must be contiguous; call .contiguous()")
    if isinstance(data, np.ndarray) and not data.flags.c_contiguous:
        raise TransferQueueError(f"field {name!r}: an ArrayColumn's array must be contiguous; use np.ascontiguousarray")
    if any(d < 0 for s in column.shapes for d in s):
        raise TransferQueueError(f"field {name!r}: row shapes must hold non-negative sizes")
    total = sum(column.numels)
    if total != data.shape[0]:
        raise TransferQueueError(
            f"field {name!r}: the row shapes add up to {total} elements, the column's data has {data.shape[0]}"
        )
