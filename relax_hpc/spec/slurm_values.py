"""Parsing of the Slurm value formats a job spec carries (time limits, memory sizes).

Pure functions, shared by the spec checks and by the launch layer (which needs the time
limit in seconds, e.g. to place the pre-emption signal before the end of the allocation).
"""

from __future__ import annotations

import re

__all__ = ["SLURM_MEMORY_PATTERN", "SLURM_TIME_FORMATS", "is_slurm_memory", "slurm_time_to_seconds"]

# sbatch --mem: a count with an optional unit suffix (K, M, G, T); no unit means megabytes.
# Matched whole (fullmatch: "$" alone would also accept a trailing newline); 12 digits are
# already an exabyte in megabytes.
SLURM_MEMORY_PATTERN = re.compile(r"[0-9]{1,12}[KMGT]?")

# The forms sbatch --time accepts, as written in its manual.
SLURM_TIME_FORMATS = "M, M:S, H:M:S, D-H, D-H:M, D-H:M:S"

# At most 9 digits a field: more is never a real limit, and int() of thousands of digits fails.
_DIGITS = re.compile(r"[0-9]{1,9}")
_NOT_A_FORM = f"expected one of the forms {SLURM_TIME_FORMATS} with whole numbers (at most 9 digits each)"


def is_slurm_memory(text: str) -> bool:
    """True for values sbatch --mem accepts, e.g. ``"64G"``, ``"512000M"``, ``"4096"``."""
    return SLURM_MEMORY_PATTERN.fullmatch(text) is not None


def _fields(text: str, count_range: tuple[int, int]) -> list[int]:
    parts = text.split(":")
    low, high = count_range
    if not low <= len(parts) <= high or not all(_DIGITS.fullmatch(part) for part in parts):
        raise ValueError(_NOT_A_FORM)
    return [int(part) for part in parts]


def slurm_time_to_seconds(text: str) -> int:
    """Seconds in a Slurm time limit; ValueError (saying what is wrong) when it is not one.

    Forms: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``. The leading field may be
    any size (``"90"`` is 90 minutes, ``"36:00:00"`` is 36 hours) except that hours are below 24
    once days are given; minutes and seconds after the leading field are below 60; the total
    must be positive. Nothing else is accepted, not even surrounding spaces: the text is written
    into a ``#SBATCH --time=`` line as it is.
    """
    days = 0
    if "-" in text:
        day_text, _, rest = text.partition("-")
        if not _DIGITS.fullmatch(day_text):
            raise ValueError(_NOT_A_FORM)
        days = int(day_text)
        fields = _fields(rest, (1, 3))
        hours, minutes, seconds = (fields + [0, 0])[:3]
        if hours >= 24:
            raise ValueError(f"hours must be below 24 when days are given, got {hours}")
        trailing = fields[1:]
    else:
        fields = _fields(text, (1, 3))
        if len(fields) == 3:
            hours, minutes, seconds = fields
        elif len(fields) == 2:
            hours, (minutes, seconds) = 0, fields
        else:
            hours, minutes, seconds = 0, fields[0], 0
        trailing = fields[1:]
    if any(value >= 60 for value in trailing):
        raise ValueError("minutes and seconds after the first field must be below 60")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise ValueError("the time limit must be longer than zero")
    return total
