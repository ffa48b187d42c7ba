"""Pure rules of the transfer layer: staleness, capacity, partition names, the wire codec."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from relax_hpc.transfer import (
    TransferQueueError,
    partition_name,
    partition_step,
    queue_capacity,
    staleness_allows,
)
from relax_hpc.transfer.queue import check_rows
from relax_hpc.transfer.wire import JOIN_BELOW_BYTES, WireError, pack_header, unpack_header
from relax_hpc.transfer.wire_decode import decode_blocks, materialize_blocks
from relax_hpc.transfer.wire_encode import blocks_to_wire, encode_blocks, stored_to_wire


@pytest.mark.parametrize(
    ("step", "oldest", "max_staleness", "allowed"),
    [
        (5, None, 0, True),  # nothing uncleared
        (1, 0, 0, False),  # on-policy: step 1 waits until train_0 is cleared
        (1, 1, 0, True),  # 1 - 1 = 0 <= 0
        (1, 0, 1, True),  # 1 - 0 = 1 <= 1
        (2, 0, 1, False),  # 2 - 0 = 2 > 1
        (7, 4, 3, True),  # 7 - 4 = 3 <= 3
        (8, 4, 3, False),  # 8 - 4 = 4 > 3
    ],
)
def test_staleness_rule(step: int, oldest: int | None, max_staleness: int, allowed: bool) -> None:
    assert staleness_allows(step, oldest, max_staleness) is allowed


def test_staleness_rejects_negative_bound() -> None:
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        staleness_allows(1, 0, -1)


def test_queue_capacity_formula() -> None:
    # 32 prompts * (2 + 1) steps in flight * 8 samples each = 768 rows
    assert queue_capacity(32, 2, 8) == 768
    assert queue_capacity(4, 0, 1) == 4
    with pytest.raises(ValueError, match="n_samples_per_prompt must be >= 1"):
        queue_capacity(4, 0, 0)


def test_partition_names() -> None:
    assert partition_name(7) == "train_7"
    assert partition_step("train_7") == 7
    assert partition_step("train_x") is None and partition_step("eval_3") is None
    with pytest.raises(ValueError, match="step must be >= 0"):
        partition_name(-1)


def test_check_rows_names_the_bad_field() -> None:
    with pytest.raises(TransferQueueError, match="field 'meta': cannot queue a dict"):
        check_rows([{"meta": {"a": 1}}])
    with pytest.raises(TransferQueueError, match="field 'objs'.*object arrays"):
        check_rows([{"objs": np.array([object()])}])
    with pytest.raises(TransferQueueError, match="only dense CPU tensors"):
        check_rows([{"sp": torch.eye(3).to_sparse()}])
    with pytest.raises(TransferQueueError, match="does not fit in 64 bits"):
        check_rows([{"big": 2**70}])


def roundtrip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Client put -> server store -> server get reply -> client, without sockets."""
    frames: list[Any] = []
    descs = blocks_to_wire(encode_blocks(rows), frames)
    header = unpack_header(pack_header({"blocks": descs}))
    wire_frames = [bytearray(memoryview(f).cast("B")) for f in frames]  # as received
    stored = decode_blocks(header["blocks"], wire_frames)
    out_frames: list[Any] = []
    reply = unpack_header(pack_header({"blocks": stored_to_wire(stored, out_frames)}))
    return materialize_blocks(reply["blocks"], [bytes(memoryview(f).cast("B")) for f in out_frames])


def assert_same_rows(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert list(g) == list(w)
        for name, value in w.items():
            if isinstance(value, torch.Tensor):
                assert isinstance(g[name], torch.Tensor) and g[name].dtype == value.dtype
                assert g[name].shape == value.shape and torch.equal(g[name], value.detach().resolve_conj())
            elif isinstance(value, np.ndarray):
                assert isinstance(g[name], np.ndarray) and g[name].shape == value.shape
                np.testing.assert_array_equal(g[name], value)
            else:
                assert g[name] == value and type(g[name]) is type(value)


def test_codec_round_trip_without_sockets() -> None:
    big_endian = np.arange(5, dtype=">i4")
    rows = [{"a": torch.randn(3, 2).to(torch.bfloat16), "b": big_endian, "c": "txt", "d": torch.ones(2, requires_grad=True)}]
    out = roundtrip(rows)[0]
    assert torch.equal(out["a"], rows[0]["a"]) and out["a"].dtype == torch.bfloat16
    np.testing.assert_array_equal(out["b"], big_endian)
    assert out["b"].dtype == np.dtype("int32") and out["c"] == "txt"
    assert torch.equal(out["d"], torch.ones(2)) and not out["d"].requires_grad


def test_a_batch_of_alike_rows_travels_as_one_block_of_columns() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = [
        {"tokens": torch.randint(0, 50, (int(n),), generator=gen), "lp": torch.randn(int(n), generator=gen),
         "mask": torch.ones(2, 3, dtype=torch.int8) * i, "scalar_t": torch.tensor(float(i)),
         "reward": float(i) / 3, "ok": i % 2 == 0, "note": None, "id": 2**63 - 1 - i, "text": f"row {i}"}
        for i, n in enumerate(torch.randint(0, 9, (40,), generator=gen))
    ]
    frames: list[Any] = []
    descs = blocks_to_wire(encode_blocks(rows), frames)
    assert len(descs) == 1 and descs[0]["n"] == 40
    assert len(frames) == 4  # one joined buffer per array field, none per row
    assert descs[0]["cols"]["reward"] == ["v", [r["reward"] for r in rows]]
    assert_same_rows(roundtrip(rows), rows)


def test_rows_of_different_shapes_travel_as_several_blocks() -> None:
    rows: list[dict[str, Any]] = [
        {"x": torch.arange(3), "y": 1}, {"x": torch.arange(2), "y": 2},  # alike
        {"x": torch.arange(2.0), "y": 3},  # another dtype
        {"x": None, "y": 4},  # a scalar where others have tensors
        {"y": 5},  # fewer fields
        {"y": 6, "x": np.arange(3, dtype=np.float64)},  # numpy, other field order
        {"x": torch.arange(1), "y": 7},
    ]
    frames: list[Any] = []
    descs = blocks_to_wire(encode_blocks(rows), frames)
    assert [d["n"] for d in descs] == [2, 1, 1, 1, 1, 1]
    assert_same_rows(roundtrip(rows), rows)


def test_large_rows_keep_a_frame_each_and_small_ones_are_joined() -> None:
    per_row = JOIN_BELOW_BYTES // 4  # float32 elements: exactly the cut-off
    big = [{"x": torch.full((per_row,), float(i))} for i in range(3)]
    frames: list[Any] = []
    descs = blocks_to_wire(encode_blocks(big), frames)
    assert descs[0]["cols"]["x"][3] == [0, 1, 2] and len(frames) == 3
    # zero-copy: the frame is the caller's tensor memory
    assert np.shares_memory(frames[1], big[1]["x"].numpy())
    assert_same_rows(roundtrip(big), big)
    small = [{"x": torch.full((per_row // 2,), float(i))} for i in range(3)]
    frames = []
    descs = blocks_to_wire(encode_blocks(small), frames)
    assert descs[0]["cols"]["x"][3] == 0 and len(frames) == 1
    assert_same_rows(roundtrip(small), small)


def test_received_rows_of_a_column_share_one_writable_buffer() -> None:
    rows = [{"x": torch.arange(4) + 10 * i} for i in range(3)]
    out = roundtrip(rows)  # the reply's frames are read-only bytes: copied once, then split
    out[0]["x"] += 1
    assert out[0]["x"].tolist() == [1, 2, 3, 4] and out[1]["x"].tolist() == [10, 11, 12, 13]
    assert out[0]["x"].untyped_storage().data_ptr() == out[2]["x"].untyped_storage().data_ptr()


def test_encoding_names_the_field_that_cannot_travel() -> None:
    with pytest.raises(TransferQueueError, match="field 'meta': cannot queue a dict"):
        encode_blocks([{"meta": 1}, {"meta": {"a": 1}}])
    with pytest.raises(TransferQueueError, match="field 'big': int .* does not fit in 64 bits"):
        encode_blocks([{"big": 1}, {"big": 2**70}])
    with pytest.raises(TransferQueueError, match="field 'sp'.*only dense CPU tensors"):
        encode_blocks([{"sp": torch.eye(3).to_sparse()}])
    with pytest.raises(TransferQueueError, match="single dict"):
        encode_blocks({"x": 1})  # type: ignore[arg-type]


def block(cols: dict[str, Any], n: int = 1) -> list[dict[str, Any]]:
    return [{"n": n, "cols": cols}]


@pytest.mark.parametrize(
    ("descs", "message"),
    [
        (block({"x": ["t", "float32", [[2]], 0]}), "need 8 bytes"),
        (block({"x": ["q", 1]}), "column must be"),
        (block({"": ["v", [1]]}), "field name"),
        (block({"x": ["t", "float32", [[1] * 40], 0]}), "at most 32"),
        (block({"x": ["t", "float32", [[1]], 0]}, n=2), "list of 2 shapes"),
        (block({"x": ["v", [1, 2]]}), r"\['v', \[1 values\]\]"),
        (block({"x": ["v", [[1]]]}), "inline value of type list"),
        (block({"x": ["t", "int8", [[2], [2]], [0, 0, 0]]}, n=2), "list of 2 ints"),
        ([{"n": 1}], "exactly 'n' and 'cols'"),
        ([{"n": -1, "cols": {}}], "block 'n'"),
        ([["x"]], "each block must be a map"),
        ({"x": 1}, "'blocks' must be a list"),
    ],
)
def test_codec_rejects_bad_columns(descs: Any, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode_blocks(descs, [b"\x00" * 4])
    with pytest.raises(WireError, match=message):
        materialize_blocks(descs, [b"\x00" * 4])


def test_header_must_be_a_map_of_plain_data() -> None:
    with pytest.raises(WireError, match="msgpack map"):
        unpack_header(msgpack.packb("ping"))
    with pytest.raises(WireError, match="not valid msgpack"):
        unpack_header(b"\x92\x01")  # truncated array
