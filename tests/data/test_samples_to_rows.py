"""samples_to_rows: a step's rows built by column are exactly the rows sample_to_row builds one
by one, through the queue's wire too (relax_hpc/data/rows.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from relax_hpc.data.rows import ROUTED_EXPERTS_FIELD, sample_to_row, samples_to_rows
from relax_hpc.data.sample import Sample
from relax_hpc.media.items import MediaItem, PromptMedia
from relax_hpc.transfer.columns import ColumnRows
from relax_hpc.transfer.wire_decode import materialize_blocks
from relax_hpc.transfer.wire_encode import blocks_to_wire, encode_blocks


def _sample(i: int, response: int, **extra: Any) -> Sample:
    return Sample(prompt_ids=[100 + i, 101 + i, 102], response_ids=list(range(i, i + response)),
                  rollout_log_probs=[-0.25 * (k + 1) for k in range(response)], weight_version=3 + i % 2,
                  group_id=i // 2, prompt_index=7 * i, reward=float(i % 2), raw_reward=0.5 * i,
                  advantage=1.5 - i, sample_id=1000 + i, **extra)


def _assert_same_rows(got: Any, want: list[dict[str, Any]]) -> None:
    got = list(got)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert list(a) == list(b)
        for name, value in b.items():
            assert type(a[name]) is type(value), name
            if isinstance(value, torch.Tensor):
                assert a[name].dtype == value.dtype and a[name].shape == value.shape, name
                assert torch.equal(a[name], value), name
            else:
                assert a[name] == value, name


def test_rows_by_column_equal_rows_one_by_one() -> None:
    samples = [_sample(0, 4), _sample(1, 0), _sample(2, 1), _sample(3, 6)]  # one with no response
    rows = samples_to_rows(samples)
    assert isinstance(rows, ColumnRows)
    _assert_same_rows(rows, [sample_to_row(s) for s in samples])
    # by hand, sample 3: prompt [103, 104, 102] then response [3..8]; mask all ones
    assert rows[3]["tokens"].tolist() == [103, 104, 102, 3, 4, 5, 6, 7, 8]
    assert rows[3]["loss_mask"].tolist() == [1] * 6 and rows[1]["loss_mask"].numel() == 0
    assert rows[2]["rollout_log_probs"].tolist() == [-0.25]
    assert (rows[3]["advantages"], rows[3]["sample_id"], rows[3]["weight_version"]) == (-1.5, 1003, 4)


def test_loss_masks_given_for_some_samples_only() -> None:
    samples = [_sample(0, 3, loss_mask=[1, 0, 1]), _sample(1, 2), _sample(2, 2, loss_mask=[0, 0])]
    rows = samples_to_rows(samples)
    _assert_same_rows(rows, [sample_to_row(s) for s in samples])
    assert [r["loss_mask"].tolist() for r in rows] == [[1, 0, 1], [1, 1], [0, 0]]


def test_without_drops_the_field_from_every_row() -> None:
    samples = [_sample(0, 2), _sample(1, 3)]
    rows = samples_to_rows(samples, without=("advantages",))
    want = [sample_to_row(s) for s in samples]
    for row in want:
        del row["advantages"]
    _assert_same_rows(rows, want)


def test_routed_experts_and_media_become_columns_too() -> None:
    rng = np.random.default_rng(0)
    media = [PromptMedia((MediaItem("image", rng.integers(0, 256, (4, 6, 3), dtype=np.uint8)),)),
             PromptMedia((MediaItem("image", rng.integers(0, 256, (2, 2, 3), dtype=np.uint8)),
                          MediaItem("audio", rng.uniform(-1, 1, 50).astype(np.float32), rate=8000.0)))]
    samples = [_sample(i, 2 + i, media=media[i],
                       routed_experts=torch.arange((4 + i) * 2 * 2, dtype=torch.uint8).reshape(4 + i, 2, 2))
               for i in range(2)]
    rows = samples_to_rows(samples)
    assert isinstance(rows, ColumnRows) and ROUTED_EXPERTS_FIELD in rows.fields
    _assert_same_rows(rows, [sample_to_row(s) for s in samples])


@pytest.mark.parametrize("odd_one", [
    {"routed_experts": torch.zeros((4, 1, 1), dtype=torch.uint8)},  # routes on one sample only
    {"media": PromptMedia(())},  # media on one sample only
])
def test_samples_with_different_optional_fields_are_built_one_by_one(odd_one: dict[str, Any]) -> None:
    samples = [_sample(0, 2), _sample(1, 2, **odd_one), _sample(2, 1)]
    rows = samples_to_rows(samples, without=("advantages",))
    assert isinstance(rows, list)
    want = [sample_to_row(s) for s in samples]
    for row in want:
        del row["advantages"]
    _assert_same_rows(rows, want)


def test_rows_by_column_survive_the_wire() -> None:
    samples = [_sample(i, i % 5, loss_mask=[i % 2] * (i % 5) if i % 3 == 0 else None) for i in range(12)]
    frames: list[Any] = []
    received = materialize_blocks(blocks_to_wire(encode_blocks(samples_to_rows(samples)), frames), frames)
    _assert_same_rows(received, [sample_to_row(s) for s in samples])


def test_no_samples_no_rows() -> None:
    assert list(samples_to_rows([])) == []
