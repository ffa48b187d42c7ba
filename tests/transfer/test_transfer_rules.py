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
from relax_hpc.transfer.wire import (
    WireError,
    decode_rows,
    encode_rows,
    encode_value_rows,
    materialize_rows,
    pack_header,
    unpack_header,
)


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
    frames: list[Any] = []
    descs = encode_rows(encode_value_rows(rows), frames)
    header = unpack_header(pack_header({"rows": descs}))
    wire_frames = [bytearray(memoryview(f).cast("B")) for f in frames]  # as received
    return materialize_rows(decode_rows(header["rows"], wire_frames))


def test_codec_round_trip_without_sockets() -> None:
    big_endian = np.arange(5, dtype=">i4")
    rows = [{"a": torch.randn(3, 2).to(torch.bfloat16), "b": big_endian, "c": "txt", "d": torch.ones(2, requires_grad=True)}]
    out = roundtrip(rows)[0]
    assert torch.equal(out["a"], rows[0]["a"]) and out["a"].dtype == torch.bfloat16
    np.testing.assert_array_equal(out["b"], big_endian)
    assert out["b"].dtype == np.dtype("int32") and out["c"] == "txt"
    assert torch.equal(out["d"], torch.ones(2)) and not out["d"].requires_grad


def test_codec_copies_read_only_frames() -> None:
    frames: list[Any] = []
    descs = encode_rows(encode_value_rows([{"x": torch.arange(4)}]), frames)
    out = materialize_rows(decode_rows(descs, [bytes(memoryview(frames[0]))]))[0]["x"]
    out += 1  # bytes are read-only: the codec must have copied them into writable memory
    assert out.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("descs", "message"),
    [
        ([{"x": ["t", "float32", [2], 0]}], "needs 8 bytes"),
        ([{"x": ["q", 1]}], "descriptor must be"),
        ([{"": ["v", 1]}], "field name"),
        ([{"x": ["t", "float32", [1] * 40, 0]}], "at most 32"),
        ([["x"]], "each row must be a map"),
    ],
)
def test_codec_rejects_bad_descriptors(descs: Any, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode_rows(descs, [b"\x00" * 4])


def test_header_must_be_a_map_of_plain_data() -> None:
    with pytest.raises(WireError, match="msgpack map"):
        unpack_header(msgpack.packb("ping"))
    with pytest.raises(WireError, match="not valid msgpack"):
        unpack_header(b"\x92\x01")  # truncated array
