"""The pre-sympy guard: which answers are too large to compute, and the math rewards using it."""

from __future__ import annotations

import pytest

from relax_hpc.rewards.guard import MAX_RESULT_DIGITS, too_large
from relax_hpc.rewards.math_answer import math_equal


@pytest.mark.parametrize(
    "answer",
    [
        "9^{9^{9}}",  # 9^387420489: about 3.7e8 digits
        "2^{2^{2^{2^{2^{10}}}}}",  # a tower: the exponent alone overflows
        "10^{10^{10^{10}}}",
        "x^{9^{9^{9}}}",  # symbolic base, but the exponent is still computed
        "2**2**2**2**2**2",  # 2^65536: 19,729 digits
        "2^{40000}",  # 12,042 digits
        "1000000!",  # 5.6 million digits
        "(10^{100})!",
        "\\binom{10^{9}}{10^{8}}",
        "1.0000001^{10^{9}}",  # 1.0000001 = 10000001/10^7: 8 digits to the 10^9th power
        "2^{-10^{9}}",  # 1 / 2^(10^9)
        "\\left(7^{7^{7^{7}}}\\right) + 1",
        "\\frac{1}{3^{3^{3^{3}}}}",
        "\\sqrt{5^{5^{5^{5}}}}",
    ],
)
def test_refuses_numbers_too_large_to_compute(answer: str) -> None:
    reason = too_large(answer)
    assert reason is not None and f"(limit {MAX_RESULT_DIGITS})" in reason


@pytest.mark.parametrize(
    "answer",
    [
        "2^{10000}",  # 3,011 digits: computed in microseconds
        "3^{4^{5}}",  # 3^1024: 489 digits
        "100!",  # 158 digits
        "\\binom{10^{9}}{5}",  # at most (10^9)^5: 45 digits
        "(x+1)^{10^{6}}",  # symbolic: sympy leaves it unexpanded
        "e^{10^{10}}",  # symbolic too
        "1^{10^{100}}",  # 1 and 0 to any power cost nothing
        "0^{10^{100}}",
        "\\frac{1}{2}",
        "\\sqrt[3]{27}",
        "12",
        "",
        "{{{{",  # unbalanced: not this guard's business
        "}}}}2^{3}",
    ],
)
def test_lets_computable_answers_through(answer: str) -> None:
    assert too_large(answer) is None


def test_absurd_nesting_is_refused_not_crashed() -> None:
    assert too_large("{" * 2000 + "1" + "}" * 2000) == "the answer nests too deeply to parse"


def test_guard_is_linear_on_long_input() -> None:
    # 200 kB of operators and groups: a quadratic guard would take minutes here.
    assert too_large("1+" * 100_000 + "1") is None
    assert too_large("(x)" * 60_000) is None
    assert too_large("(2)" * 60_000) is not None  # 2^60000, written out as a product


def test_huge_answers_are_wrong_unless_they_match_the_label_as_written() -> None:
    assert not math_equal("9^{9^{9}}", "3")
    assert not math_equal("3", "10^{10^{10^{10}}}")
    assert math_equal("10^{10^{10^{10}}}", "10^{10^{10^{10}}}")  # the string fast path
    assert math_equal("9^{ 9^{9} }", "$9^{9^{9}}$")  # spacing and $ normalised away
    assert math_equal("2^{10}", "1024")  # small powers still reach math-verify
