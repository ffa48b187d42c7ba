"""Single-value checks attached to schema fields (ranges, name patterns, Slurm formats).

A check is a callable that receives a value of the field's declared type (the type itself
is checked first by the loader) and returns None when the value is fine, or a message that
finishes the sentence "<key> = <value>: ..." and says what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relax_hpc.spec.slurm_values import SLURM_TIME_FORMATS, is_slurm_memory, slurm_time_to_seconds

__all__ = [
    "MAX_GPUS_PER_NODE",
    "Check",
    "Range",
    "at_least",
    "at_most_gpus_per_node",
    "each",
    "env_assignments",
    "exact_length",
    "greater_than",
    "job_name",
    "non_empty",
    "non_empty_items",
    "reward_function",
    "slurm_memory",
    "slurm_time",
    "within",
]

Check = Callable[[Any], "str | None"]

# The densest nodes in service carry 8 GPUs, a few 16; a larger number is a typo.
MAX_GPUS_PER_NODE = 16

_JOB_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _number(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class Range:
    """A numeric interval; an open end excludes its bound, a None end is unbounded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            left = "(" if self.low_open else "["
            right = ")" if self.high_open else "]"
            return f"in {left}{_number(self.low)}, {_number(self.high)}{right}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_number(self.high)}"
        return "a number"

    def contains(self, value: float) -> bool:
        # Each bound must hold (rather than "no bound is broken") so that NaN, for which
        # every comparison is False, is rejected.
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        if self.high is not None and not (value < self.high if self.high_open else value <= self.high):
            return False
        return True

    def __call__(self, value: float) -> str | None:
        return None if self.contains(value) else f"must be {self.describe()}"


def at_least(low: float) -> Range:
    return Range(low=low)


def greater_than(low: float) -> Range:
    return Range(low=low, low_open=True)


def within(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Range:
    return Range(low=low, high=high, low_open=low_open, high_open=high_open)


def exact_length(count: int) -> Check:
    def check(values: Sequence[object]) -> str | None:
        if len(values) == count:
            return None
        return f"must hold exactly {count} values, got {len(values)}"

    return check


def each(inner: Range) -> Check:
    """Apply a range to every element of a list, naming the first element that fails."""

    def check(values: Sequence[float]) -> str | None:
        for index, item in enumerate(values):
            if not inner.contains(item):
                return f"element {index} ({item!r}) must be {inner.describe()}"
        return None

    return check


def at_most_gpus_per_node(value: int) -> str | None:
    if value > MAX_GPUS_PER_NODE:
        return f"no Slurm node has more than {MAX_GPUS_PER_NODE} GPUs; check the value"
    return None


def non_empty(value: str) -> str | None:
    return "must not be empty" if not value.strip() else None


def job_name(value: str) -> str | None:
    # "." and ".." match the character set but would make the job directory runs/. or
    # runs/.., i.e. an existing directory shared with other jobs.
    if _JOB_NAME.match(value) is None or set(value) == {"."}:
        return "must be 1..64 characters from A-Z a-z 0-9 _ . - (and not only dots)"
    return None


def reward_function(value: str) -> str | None:
    if value.isidentifier():
        return None
    module, colon, name = value.partition(":")
    if colon and name.isidentifier() and module and all(p.isidentifier() for p in module.split(".")):
        return None
    return 'must be a built-in reward name (e.g. "math") or "package.module:function"'


def slurm_memory(value: str) -> str | None:
    if is_slurm_memory(value):
        return None
    return 'must be a Slurm memory size: digits with an optional unit K, M, G or T, e.g. "64G"'


def slurm_time(value: str) -> str | None:
    try:
        slurm_time_to_seconds(value)
    except ValueError as error:
        return f"is not a Slurm time limit ({error}); forms: {SLURM_TIME_FORMATS}"
    return None


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def env_assignments(values: Sequence[str]) -> str | None:
    """Every element is ``NAME=VALUE`` with a shell-safe variable name."""
    for index, item in enumerate(values):
        name, equals, _ = item.partition("=")
        if not equals or _ENV_NAME.match(name) is None:
            return f'element {index} ({item!r}) must be "NAME=VALUE" with NAME from A-Z a-z 0-9 _ (not starting with a digit)'
    return None


def non_empty_items(values: Sequence[str]) -> str | None:
    for index, item in enumerate(values):
        if not item.strip():
            return f"element {index} must not be empty"
    return None
