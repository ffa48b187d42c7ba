"""Math rewards: answer extraction plus symbolic equivalence through the `math-verify` library.

Three rewards share one equivalence test (`math_equal`):
- `math_reward`: last \\boxed{} (else the last "Answer:" line), 1 when equivalent, else 0;
- `dapo_reward`: DAPO's answer rule (veRL's math_dapo extraction): the last "Answer:" line
  within the final 300 characters; 1.0 when correct, -1.0 otherwise (no answer, a timeout or
  an error included). Equality is math-verify's, not math_dapo's string match;
- `deepscaler_reward`: DeepScaleR's rule (slime's rm_hub): only the text after "</think>" (or
  "###Response") counts, the last \\boxed{} there; 1 when correct, 0 otherwise.

Equivalence: trailing unit words dropped ("12 dollars" -> "12"), a normalised string match, then math-verify on both sides wrapped in
\\boxed{} (fractions, decimals, \\dfrac, units like "5 cm", thousands separators, sets,
intervals, symbolic expressions). Before either side reaches sympy, relax_hpc.rewards.guard
refuses numbers too large to compute (power towers, huge factorials): such an answer is wrong
unless it matches the label as a string. math-verify's own timeouts use SIGALRM, which only
works on a main thread, so they are off here: these rewards run in the reward pool's worker
processes, which are killed past `timeout_s`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.extract import after_thinking, answer_line, last_boxed, tail
from relax_hpc.rewards.guard import too_large
from relax_hpc.rewards.registry import scores_failure_as

# DAPO looks at the last 300 characters only (verl's math_dapo.compute_score).
DAPO_WINDOW_CHARS = 300
# A "final answer" longer than this is not an answer; parsing it would only burn CPU.
MAX_ANSWER_CHARS = 1000


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as e:  # pragma: no cover - exercised only without the package
        raise ImportError(
            "the math rewards (math, dapo, deepscaler, openr1mm) need the 'math-verify' package: "
            "pip install 'math-verify>=0.7'"
        ) from e
    # It warns on every call that timeouts are off; that is intended here (see module docstring).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def normalize_answer(text: str) -> str:
    """Cheap canonical form for the string fast path: no spaces, $, trailing dot, \\left/\\right."""
    out = text.strip().strip("$").rstrip(".")
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", " "):
        out = out.replace(token, "")
    return out.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


# "12 dollars", "30 degrees", "45 mph": a number followed by plain words of 3+ letters. Words are
# separated by required blanks, so the pattern cannot backtrack over how to split a word.
_NUMBER_THEN_WORDS = re.compile(r"\s*([-+]?\\?\$?[\d.,]+(?:/\d+)?)\s+[A-Za-z]{3,}(?:\s+[A-Za-z]{3,})*\.?\s*")


def drop_unit_words(answer: str) -> str:
    """The number of "12 dollars" (math-verify reads the word as a product of letters)."""
    found = _NUMBER_THEN_WORDS.fullmatch(answer)
    return found.group(1) if found else answer


def _strip_wrappers(label: str) -> str:
    boxed = last_boxed(label)
    return boxed if boxed is not None else label.strip().strip("$")


def math_equal(pred: str, gold: str) -> bool:
    """True when `pred` and `gold` are the same mathematical answer. Never raises."""
    if not pred or len(pred) > MAX_ANSWER_CHARS:
        return False
    gold = drop_unit_words(_strip_wrappers(gold))
    pred = drop_unit_words(pred)
    if normalize_answer(pred) == normalize_answer(gold):
        return True
    if too_large(pred) is not None or too_large(gold) is not None:
        return False
    mv = _math_verify()
    try:
        gold_parsed = mv.parse("\\boxed{" + gold + "}", parsing_timeout=None)
        pred_parsed = mv.parse("\\boxed{" + pred + "}", parsing_timeout=None)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(mv.verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except Exception:  # math-verify/sympy raise many kinds on odd input; odd input is wrong
        return False


def _labels(label: Any) -> list[str]:
    if isinstance(label, (list, tuple)):
        return [str(x) for x in label if x is not None]
    return [] if label is None else [str(label)]


def matches_any(pred: str | None, label: Any) -> bool:
    return pred is not None and any(math_equal(pred, gold) for gold in _labels(label))


def extract_math_answer(response: str) -> str | None:
    """The final answer of a math response: the last \\boxed{}, else the last "Answer:" line."""
    text = tail(response)
    boxed = last_boxed(text)
    return boxed if boxed is not None else answer_line(text)


def _details(pred: str | None) -> dict[str, float]:
    return {"has_answer": float(pred is not None), "too_large": float(pred is not None and too_large(pred) is not None)}


@scores_failure_as(0.0)
def math_reward(sample: Sample) -> dict[str, float]:
    pred = extract_math_answer(sample.response_text)
    correct = matches_any(pred, sample.label)
    return {"score": float(correct), **_details(pred)}


@scores_failure_as(-1.0)
def dapo_reward(sample: Sample) -> dict[str, float]:
    pred = answer_line(sample.response_text, window=DAPO_WINDOW_CHARS)
    correct = matches_any(pred, sample.label)
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), **_details(pred)}


@scores_failure_as(0.0)
def deepscaler_reward(sample: Sample) -> dict[str, float]:
    solution = after_thinking(sample.response_text)
    pred = last_boxed(tail(solution)) if solution is not None else None
    correct = matches_any(pred, sample.label)
    return {"score": float(correct), **_details(pred)}
