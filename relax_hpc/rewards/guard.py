"""Refuse math answers whose value cannot be computed within limits, before sympy tries.

sympy evaluates integer powers, factorials and binomials eagerly: parsing `9^{9^{9}}` starts
computing a number with 370 million digits, holding the interpreter lock, and
`2^{2^{2^{2^{2^{10}}}}}` took 6.8 GB in two minutes before it was stopped. A policy under RL
finds such answers. `too_large(text)` reads the answer the way a LaTeX parser would (numbers,
`^` / `**`, `!`, `\\frac`, `\\binom`, `\\sqrt`, groups) and bounds, for every numeric
subexpression, how many digits computing it exactly would take; it returns why the answer is
refused when one of them would exceed MAX_RESULT_DIGITS, else None.

Symbols (`x`, `\\pi`, `e`) make an expression symbolic: sympy keeps `x^{10^{10}}` unevaluated,
so only its numeric parts are bounded (`x^{9^{9^{9}}}` is still refused for its exponent).
Only ASCII digits are numbers; other digits (`²`, `٣`) are symbols, as the parsers read them.

A `!` after a power applies to the whole power, as LaTeX reads it: `10^{6}!` is `(10^6)!`, not
`10^{720}`. Unbraced, `10^6!` is that too in LaTeX but `10**(6!)` in sympy's own syntax, so both
are bounded. The estimate is an upper bound and linear in the answer's length; odd input never
raises: an answer the estimate itself fails on is refused.
"""

from __future__ import annotations

import math
import re

# No competition answer has more digits than this; computing 10^5-digit numbers exactly already
# costs sympy noticeable time, and math-verify then fails on them anyway (int -> str limit).
MAX_RESULT_DIGITS = 10_000

# Tokens: a number, a LaTeX command, a two-character operator, or any other single character.
_TOKEN = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+|\\[A-Za-z]+|\\.|\*\*|\S")
_SKIPPED = {"\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle", "$"}
_FRACTIONS = {"\\frac", "\\dfrac", "\\tfrac", "\\cfrac"}
_BINOMIALS = {"\\binom", "\\dbinom", "\\tbinom"}
_OPEN = {"{": "}", "(": ")", "[": "]"}
_CLOSE = set(_OPEN.values())
_LOW_PRECEDENCE = {"+", "-", "=", ",", ";", "<", ">", "\\pm", "\\mp", "\\le", "\\ge", "\\leq", "\\geq", "\\ne"}
_PRODUCT = {"*", "/", "\\cdot", "\\times", "\\div"}
_LOG10_E = math.log10(math.e)


class TooLarge(Exception):
    """Raised inside the estimate when a subexpression is over the limit."""


def too_large(text: str, max_digits: int = MAX_RESULT_DIGITS) -> str | None:
    """Why `text` must not reach sympy (a sentence), or None when it is safe to parse."""
    tokens = [t for t in _TOKEN.findall(text) if t not in _SKIPPED]
    estimate = _Estimate(tokens, max_digits)
    try:
        while (token := estimate.peek()) is not None:
            if token in _CLOSE:  # a stray closing bracket: skip it and go on
                estimate.take()
                continue
            estimate.expression()
    except TooLarge as e:
        return str(e)
    except RecursionError:
        return "the answer nests too deeply to parse"
    except Exception as e:  # a bug here must refuse the answer, never raise into the scorer
        return f"the guard could not read the answer ({type(e).__name__}): refused before sympy"
    return None


class _Estimate:
    """Recursive descent over the tokens.

    Each method returns the size of what it read: an upper bound on log10 of its exact value's
    numerator and denominator together (about its digits), or None when it is symbolic and
    sympy leaves it unevaluated.
    """

    def __init__(self, tokens: list[str], max_digits: int) -> None:
        self.tokens, self.max_digits, self.pos = tokens, max_digits, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def check(self, digits: float, what: str) -> float:
        if digits > self.max_digits:
            shown = f"{digits:.2g}" if math.isfinite(digits) else "infinitely many"
            raise TooLarge(f"{what} has about {shown} digits (limit {self.max_digits}): refused before sympy")
        return digits

    def expression(self) -> float | None:
        total = self.term()
        while self.peek() in _LOW_PRECEDENCE:
            self.take()
            total = _combine(total, self.term())
        return total

    def term(self) -> float | None:
        total = self.signed()
        while (token := self.peek()) is not None and token not in _LOW_PRECEDENCE and token not in _CLOSE:
            if token in _PRODUCT:
                self.take()
            total = _combine(total, self.signed())
            if total is not None:
                self.check(total, "a product")
        return total

    def signed(self) -> float | None:
        while self.peek() in ("-", "+"):
            self.take()
        return self.power()

    def power(self) -> float | None:
        base = self.postfix()
        if self.peek() not in ("^", "**"):
            return base
        return self.factorials(self.raised(base))  # LaTeX: a ! after a power takes the whole power

    def raised(self, base: float | None) -> float | None:
        """`base` to the exponent after the `^`: a braced group or one atom, right-associative
        (a^b^c is bounded as a^(b^c), the larger reading)."""
        self.take()
        while self.peek() in ("-", "+"):
            self.take()
        latex_group = self.peek() == "{"  # then the exponent ends at its "}": LaTeX only
        exponent = self.group() if self.peek() in _OPEN else self.atom()
        if self.peek() in ("^", "**"):
            exponent = self.raised(exponent)
        elif not latex_group and self.peek() == "!":
            # sympy's own syntax reads 10**6! and 10**(6)! with the ! on the exponent: bound that too
            self.raise_to(base, self.factorials(exponent, consume=False))
        return self.raise_to(base, exponent)

    def raise_to(self, base: float | None, exponent: float | None) -> float | None:
        if base is None or exponent is None:
            return None
        # |a^b| needs |b| times the digits of a; |b| is at most 10^(digits of b).
        value = _power_of_ten(exponent)
        return self.check(value * base if base > 0 else 0.0, "a power")

    def factorials(self, digits: float | None, consume: bool = True) -> float | None:
        """`digits` through the `!`s that follow (taken from the tokens unless `consume` is False)."""
        at = self.pos
        while at < len(self.tokens) and self.tokens[at] == "!":
            at += 1
            if digits is not None:
                n = _power_of_ten(digits)
                # log10(n!) = lgamma(n + 1) / ln 10; at most n log10 n.
                digits = self.check(math.lgamma(n + 1) * _LOG10_E if n < 1e300 else math.inf, "a factorial")
        if consume:
            self.pos = at
        return digits

    def postfix(self) -> float | None:
        return self.factorials(self.atom())

    def atom(self) -> float | None:
        token = self.peek()
        if token is None:
            return 0.0
        if token in _OPEN:
            return self.group()
        self.take()
        if token[0] in "0123456789.":
            return _number_digits(token)
        if token in _FRACTIONS:
            return _combine(self.argument(), self.argument())
        if token in _BINOMIALS:
            top, bottom = self.argument(), self.argument()
            if top is None:
                return None
            # C(n, k) <= 2^n and <= n^k.
            bound = _power_of_ten(top) * math.log10(2)
            if bottom is not None:
                bound = min(bound, _power_of_ten(bottom) * top)
            return self.check(bound, "a binomial")
        if token == "\\sqrt":
            if self.peek() == "[":
                self.group()
            return self.argument()
        return None  # a symbol or a command sympy keeps symbolic

    def argument(self) -> float | None:
        """A command's argument: a braced group, or the single atom that follows."""
        return self.group() if self.peek() in _OPEN else self.atom()

    def group(self) -> float | None:
        self.take()
        inner: float | None = 0.0
        first = True
        # Any closing bracket ends the group: a mismatched one too.
        while (token := self.peek()) is not None and token not in _CLOSE:
            read = self.expression()
            inner, first = (read if first else _combine(inner, read)), False
        if self.peek() is not None:
            self.take()
        return inner


def _combine(a: float | None, b: float | None) -> float | None:
    """Size of a sum, product or quotient: at most both sides' together (log10(ab) = log10 a +
    log10 b; a sum or a rational's common denominator stays within that too)."""
    if a is None or b is None:
        return None
    return a + b


def _power_of_ten(digits: float) -> float:
    """The largest value a number with this many digits can have."""
    return math.inf if digits > 300 else 10.0**digits


def _number_digits(token: str) -> float:
    """Digits of a written number: log10 of an integer, the digit count of a decimal."""
    if "." in token:
        return float(sum(c.isdigit() for c in token))
    value = int(token) if len(token) < 300 else 10 ** 300
    return math.log10(value) if value > 1 else 0.0
