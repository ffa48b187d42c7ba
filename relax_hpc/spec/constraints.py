"""Single-value checks attached to schema fields (ranges and their bounds, Slurm formats).

A check is a callable that receives a value of the field's declared type (the type itself
is checked first by the loader, which also refuses inf and nan for every float) and returns
None when the value is fine, or a message that finishes the sentence "<key> = <value>: ..."
and says what is allowed. Checks of strings that reach the batch script or a command line
live in relax_hpc/spec/text_checks.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relax_hpc.spec.slurm_values import SLURM_TIME_FORMATS, is_slurm_memory, slurm_time_to_seconds

__all__ = [
    "MAX_COUNT",
    "MAX_CPUS_PER_NODE",
    "MAX_GPUS_PER_NODE",
    "MAX_LOCAL_WORKERS",
    "MAX_MEMORY_MB",
    "MAX_NODES",
    "MAX_RETRIES",
    "MAX_SEED",
    "MAX_SIGNAL_GRACE_S",
    "MAX_STEPS",
    "MAX_TIMEOUT_S",
    "MAX_TIME_LIMIT_DAYS",
    "MAX_TOKENS",
    "Check",
    "Range",
    "at_least",
    "at_most_gpus_per_node",
    "each",
    "exact_length",
    "greater_than",
    "non_empty",
    "reward_function",
    "slurm_memory",
    "slurm_time",
    "within",
]

Check = Callable[[Any], "str | None"]

# Upper bounds of counts. Generous on purpose: they exist so that a typo (or a hostile spec)
# such as steps = 2**63 - 1 is refused with the key named instead of failing somewhere deep
# in a run; docs/spec.md lists them with their keys.
# The densest nodes in service carry 8 GPUs, a few 16; a larger number is a typo.
MAX_GPUS_PER_NODE = 16
MAX_NODES = 100_000  # nodes of one component; the largest machines have ~10^4
MAX_CPUS_PER_NODE = 10_000
MAX_STEPS = 10_000_000  # training steps, checkpoint intervals, staleness
MAX_COUNT = 1_000_000  # prompts, samples, batches, rounds, turns, engines, processes, concurrency
MAX_TOKENS = 10_000_000  # token budgets and top_k
MAX_LOCAL_WORKERS = 4_096  # process pools on one machine
MAX_RETRIES = 100
MAX_MEMORY_MB = 1_000_000_000  # a petabyte
MAX_TIMEOUT_S = 1_000_000  # ~11.6 days
# Slurm's --signal takes at most 65535 seconds (man sbatch).
MAX_SIGNAL_GRACE_S = 65_535
# numpy and torch seeds are 32/64-bit; the rollout derives per-step seeds from this one.
MAX_SEED = 2**32 - 1
# A Slurm time limit longer than a year is a typo (Slurm itself counts minutes in 32 bits).
MAX_TIME_LIMIT_DAYS = 365


def _number(value: float) -> str:
    # Integer bounds print in full (10000000, not 1e+07): the reader compares digits.
    return str(value) if isinstance(value, int) else f"{value:g}"


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
    return 'must be a Slurm memory size: 1..12 digits with an optional unit K, M, G or T, e.g. "64G"'


def slurm_time(value: str) -> str | None:
    try:
        seconds = slurm_time_to_seconds(value)
    except ValueError as error:
        return f"is not a Slurm time limit ({error}); forms: {SLURM_TIME_FORMATS}"
    if seconds > MAX_TIME_LIMIT_DAYS * 86_400:
        return f"is longer than {MAX_TIME_LIMIT_DAYS} days; check the value (forms: {SLURM_TIME_FORMATS})"
    return None
