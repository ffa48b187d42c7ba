"""ColumnRows: rows held by column are the same rows as a list of dicts, to every queue, and
their arrays leave for the wire without a copy or a per-row pass (relax_hpc/transfer/columns.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transfer_harness import QueueHarness

from relax_hpc.transfer import TransferQueueError
from relax_hpc.transfer.columns import ArrayColumn, ColumnRows
from relax_hpc.transfer.wire_decode import materialize_blocks
from relax_hpc.transfer.wire_encode import array_buffers, blocks_to_wire, encode_blocks


def _columns() -> ColumnRows:
    # three rows: tokens of 2, 0 and 3 elements; a [2, 2] float block per row; numpy bytes
    return ColumnRows(3, {
        "tokens": ArrayColumn.of_lengths(torch.tensor([1, 2, 3, 4, 5], dtype=torch.int64), [2, 0, 3]),
        "block": ArrayColumn(torch.arange(12, dtype=torch.float32), [(2, 2)] * 3),
        "raw": ArrayColumn(np.array([9, 8, 7], dtype=np.uint8), [(1,), (1,), (1,)]),
        "uid": [10, 11, 12],
        "reward": [0.5, None, 1.0],
        "name": ["a", "b", "c"],
    })


def _dicts() -> list[dict[str, Any]]:
    """The same rows, written out by hand."""
    blocks = torch.arange(12, dtype=torch.float32).reshape(3, 2, 2)
    return [
        {"tokens": torch.tensor([1, 2]), "block": blocks[0], "raw": np.array([9], np.uint8), "uid": 10,
         "reward": 0.5, "name": "a"},
        {"tokens": torch.tensor([], dtype=torch.int64), "block": blocks[1], "raw": np.array([8], np.uint8),
         "uid": 11, "reward": None, "name": "b"},
        {"tokens": torch.tensor([3, 4, 5]), "block": blocks[2], "raw": np.array([7], np.uint8), "uid": 12,
         "reward": 1.0, "name": "c"},
    ]


def _assert_same_rows(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert list(a) == list(b)
        for name in b:
            x, y = a[name], b[name]
            assert type(x) is type(y), name
            if isinstance(y, torch.Tensor):
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
            elif isinstance(y, np.ndarray):
                assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
            else:
                assert x == y, name


def test_indexing_builds_each_row_as_views_of_the_columns() -> None:
    rows = _columns()
    assert len(rows) == 3 and rows.fields == ["tokens", "block", "raw", "uid", "reward", "name"]
    _assert_same_rows(list(rows), _dicts())
    _assert_same_rows([rows[-1]], _dicts()[2:])
    _assert_same_rows(rows[1:], _dicts()[1:])
    tokens = rows.columns["tokens"]
    assert isinstance(tokens, ArrayColumn)
    assert rows[2]["tokens"].data_ptr() == tokens.data.data_ptr() + 2 * 8  # a view, not a copy
    with pytest.raises(IndexError):
        rows[3]


@pytest.mark.parametrize(("columns", "message"), [
    ({"uid": [1, 2]}, "'uid': a column must be a list of 3 values"),
    ({"uid": [1, 2, 2**64]}, "'uid': int 18446744073709551616 does not fit in 64 bits"),
    ({"uid": [1, 2, -(2**63) - 1]}, "does not fit in 64 bits"),
    ({"text": ["a", "b", "x" * 70_000]}, "'text': str of 70000 chars is longer than"),
    ({"obj": [1, 2, object()]}, "'obj': cannot queue a object"),
    ({"t": [1, 2, torch.zeros(1)]}, "'t': arrays go in an ArrayColumn"),
    ({"t": ArrayColumn.of_lengths(torch.zeros(4), [1, 1, 1])}, "'t': the row shapes add up to 3 elements, the column's data has 4"),
    ({"t": ArrayColumn.of_lengths(torch.zeros(3), [1, 1])}, "'t': 2 row shapes for 3 rows"),
    ({"t": ArrayColumn(torch.zeros(3, 1), [(1,)] * 3)}, "'t': an ArrayColumn's data must be a 1-D"),
    ({"t": ArrayColumn(torch.zeros(6)[::2], [(1,)] * 3)}, "'t': an ArrayColumn's tensor must be contiguous"),
    ({"o": ArrayColumn(np.array([1, "a", None], dtype=object), [(1,)] * 3)}, "'o': numpy object arrays cannot be queued"),
    ({"": [1, 2, 3]}, "field name must be a non-empty str"),
])
def test_bad_columns_are_refused_naming_the_field(columns: dict[str, Any], message: str) -> None:
    with pytest.raises(TransferQueueError, match=None) as info:
        ColumnRows(3, columns)
    assert message in str(info.value)


def test_the_wire_carries_each_array_column_as_its_own_buffer() -> None:
    rows = _columns()
    blocks = encode_blocks(rows)
    buffers = array_buffers(blocks)
    assert len(blocks) == 1 and len(buffers) == 3  # one buffer per array field, not per row
    tokens = rows.columns["tokens"]
    assert isinstance(tokens, ArrayColumn)
    assert np.shares_memory(buffers[0], tokens.data.numpy())  # sent from the column itself
    frames: list[Any] = []
    received = materialize_blocks(blocks_to_wire(blocks, frames), frames)
    _assert_same_rows(received, _dicts())
    # the same descriptors as the rows written out as dicts (which the encoder joins itself)
    dict_frames: list[Any] = []
    assert blocks_to_wire(encode_blocks(_dicts()), dict_frames) == blocks_to_wire(blocks, [])
    assert [bytes(memoryview(f)) for f in dict_frames] == [bytes(memoryview(f)) for f in frames]


def test_an_empty_column_rows_puts_nothing() -> None:
    assert encode_blocks(ColumnRows(0, {"uid": []})) == []


def test_every_queue_takes_column_rows_as_the_rows_they_hold(harness: QueueHarness) -> None:
    q = harness.start()
    assert q.put("train_0", _columns()) == [0, 1, 2]
    q.complete("train_0", 3)
    batch = q.get("train_0", "actor", ["tokens", "block", "raw", "uid", "reward", "name"], 3, timeout=10)
    assert batch.end and batch.indices == [0, 1, 2]
    _assert_same_rows(batch.rows, _dicts())


def test_a_server_with_a_small_frame_limit_gets_the_column_cut_per_row() -> None:
    from relax_hpc.auth import JobSecret
    from relax_hpc.transfer.zmq_client import TransferQueueClient
    from relax_hpc.transfer.zmq_server import TransferQueueServer

    secret = JobSecret.generate()
    server = TransferQueueServer("tcp://127.0.0.1:0", secret=secret, shm=False, max_frame_bytes=64 * 1024)
    address = server.start()
    client = TransferQueueClient(address, secret=secret, connect_timeout=5.0, request_timeout=5.0)
    try:
        n, width = 64, 1024  # 64 rows of 8 KiB: 512 KiB in the column, each row within the limit
        rows = ColumnRows(n, {"tokens": ArrayColumn.of_lengths(torch.arange(n * width, dtype=torch.int64), [width] * n)})
        client.put("train_0", rows)
        client.complete("train_0", n)
        batch = client.get("train_0", "actor", ["tokens"], n, timeout=10)
        assert [int(r["tokens"][0]) for r in batch.rows] == [i * width for i in range(n)]
        assert all(torch.equal(r["tokens"], torch.arange(i * width, (i + 1) * width)) for i, r in enumerate(batch.rows))
    finally:
        client.close()
        server.stop()
