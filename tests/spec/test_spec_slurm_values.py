"""Slurm time limits and memory sizes, as accepted by sbatch."""

from __future__ import annotations

import pytest

from relax_hpc.spec import slurm_time_to_seconds
from relax_hpc.spec.slurm_values import is_slurm_memory


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30 * 60),  # M
        ("90", 90 * 60),  # M may exceed 59 when it leads
        ("5:30", 5 * 60 + 30),  # M:S
        ("01:00:00", 3600),  # H:M:S
        ("36:00:00", 36 * 3600),  # H may exceed 23 without days
        ("2-0", 2 * 86400),  # D-H
        ("1-12", 86400 + 12 * 3600),  # D-H
        ("1-2:30", 86400 + 2 * 3600 + 30 * 60),  # D-H:M
        ("1-02:03:04", 86400 + 2 * 3600 + 3 * 60 + 4),  # D-H:M:S
    ],
)
def test_time_forms(text: str, seconds: int) -> None:
    assert slurm_time_to_seconds(text) == seconds


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("0", "longer than zero"),
        ("0:00:00", "longer than zero"),
        ("1:60", "below 60"),
        ("1:60:00", "below 60"),
        ("1:00:60", "below 60"),
        ("1-24", "below 24"),
        ("1-2:60", "below 60"),
        ("", "forms"),
        ("1h", "forms"),
        ("1:2:3:4", "forms"),
        ("-1", "forms"),
        ("1-", "forms"),
        ("1--2", "forms"),
        ("UNLIMITED", "forms"),
    ],
)
def test_bad_times_say_why(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        slurm_time_to_seconds(text)


@pytest.mark.parametrize(
    ("text", "ok"), [("64G", True), ("100", True), ("2T", True), ("64g", False), ("G", False), ("-1G", False)]
)
def test_memory(text: str, ok: bool) -> None:
    assert is_slurm_memory(text) is ok
