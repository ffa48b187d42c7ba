"""Sample ids: the packing of (step, group, member), numbering a step's groups, the queue row."""

from __future__ import annotations

import pytest

from relax_hpc.data.rows import ARCHIVE_FIELDS, TRAIN_FIELDS, row_to_sample, sample_to_row
from relax_hpc.data.sample import (
    NO_SAMPLE_ID, SAMPLE_ID_MAX_STEP, Sample, assign_sample_ids, format_sample_id, make_sample_id,
    split_sample_id,
)


def _sample(group_id: int = 0) -> Sample:
    return Sample([1, 2], [3], [-0.5], weight_version=0, group_id=group_id, prompt_index=7)


def test_ids_read_as_decimal_fields_and_split_back() -> None:
    # (12 * 10**6 + 3) * 10**6 + 5 = 12_000_003_000_005
    assert make_sample_id(12, 3, 5) == 12_000_003_000_005
    assert split_sample_id(12_000_003_000_005) == (12, 3, 5)
    assert format_sample_id(12_000_003_000_005) == "s12-g3-m5"
    assert format_sample_id(NO_SAMPLE_ID) == "unassigned"
    top = make_sample_id(SAMPLE_ID_MAX_STEP, 10**6 - 1, 10**6 - 1)
    assert top < 2**63 and split_sample_id(top) == (SAMPLE_ID_MAX_STEP, 10**6 - 1, 10**6 - 1)


@pytest.mark.parametrize("args", [(-1, 0, 0), (0, 10**6, 0), (0, 0, 10**6), (SAMPLE_ID_MAX_STEP + 1, 0, 0)])
def test_ids_out_of_range_are_refused(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="out of range"):
        make_sample_id(*args)


def test_assign_numbers_group_positions_then_members_and_keeps_empty_groups() -> None:
    groups = [[_sample(10), _sample(10)], [], [_sample(12)]]  # an agentic group may be empty
    assign_sample_ids(4, groups)
    assert [[format_sample_id(s.sample_id) for s in g] for g in groups] == [
        ["s4-g0-m0", "s4-g0-m1"], [], ["s4-g2-m0"]]


def test_the_queue_row_carries_the_id_and_an_older_row_reads_unassigned() -> None:
    s = _sample()
    assert s.sample_id == NO_SAMPLE_ID  # existing constructors keep working
    s.sample_id = make_sample_id(1, 2, 3)
    row = sample_to_row(s)
    assert row["sample_id"] == 1_000_002_000_003
    assert row_to_sample(row).sample_id == 1_000_002_000_003
    del row["sample_id"]
    assert row_to_sample(row).sample_id == NO_SAMPLE_ID
    # The trainer asks for the id only when it archives; training does not need it.
    assert "sample_id" in ARCHIVE_FIELDS and "sample_id" not in TRAIN_FIELDS
