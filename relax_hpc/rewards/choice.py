"""Multiple-choice rewards (`multiple_choice`, `gpqa`): the chosen option letter against the label.

The response's choice is read from, in order: the last <answer>...</answer>, the last \\boxed{},
the last "Answer: X" / "answer is (X)" phrase, and (gpqa only) a response that is just a letter.
The label is a letter ("B", "(B)", "<answer>B</answer>") or the text of the correct option, which
is turned into its letter through the row's `choices` / `options` metadata list.
"""

from __future__ import annotations

import re
from typing import Any

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.extract import answer_tag, last_boxed, tail
from relax_hpc.rewards.registry import inline_reward

_PHRASE = re.compile(r"(?i:answer)(?:\s+is)?\s*[:\s]\s*\(?\s*([A-Z])\b\)?")
_LETTER_ONLY = re.compile(r"^\s*\(?([A-Za-z])\)?[.)]?\s*$")


def _letter(text: str | None, letters: str) -> str | None:
    if text is None:
        return None
    found = _LETTER_ONLY.match(text)
    if found and found.group(1).upper() in letters:
        return found.group(1).upper()
    return None


def choice_letter(response: str, letters: str = "ABCDEFGHIJ") -> str | None:
    """The option letter a response picks, or None when it picks none it can be held to."""
    text = tail(response)
    for candidate in (answer_tag(text), last_boxed(text)):
        letter = _letter(candidate, letters)
        if letter is not None:
            return letter
    # Whitespace runs collapsed first: the phrase pattern backtracks quadratically on long ones
    # ("answer is" followed by 200 blanks took 0.6 s a sample).
    phrases = [m.upper() for m in _PHRASE.findall(" ".join(text.split())) if m.upper() in letters]
    if phrases:
        return phrases[-1]
    return _letter(text, letters)


def _choices(metadata: dict[str, Any]) -> list[str]:
    for key in ("choices", "options"):
        value = metadata.get(key)
        if isinstance(value, list):
            return [str(v) for v in value]
    return []


def label_letter(label: Any, metadata: dict[str, Any], letters: str) -> str | None:
    """The correct letter from a letter label, or from an option-text label and the row's choices."""
    if label is None:
        return None
    text = str(label).strip()
    inner = answer_tag(text)
    text = inner if inner is not None else text
    letter = _letter(text, letters)
    if letter is not None:
        return letter
    for index, option in enumerate(_choices(metadata)):
        if option.strip().lower() == text.lower() and index < len(letters):
            return letters[index]
    return None


def _reward(sample: Sample, letters: str) -> dict[str, float]:
    want = label_letter(sample.label, sample.metadata, letters)
    got = choice_letter(sample.response_text, letters)
    return {"score": float(want is not None and got == want), "has_answer": float(got is not None)}


@inline_reward
def multiple_choice_reward(sample: Sample) -> dict[str, float]:
    return _reward(sample, "ABCDEFGHIJ")


@inline_reward
def gpqa_reward(sample: Sample) -> dict[str, float]:
    # GPQA questions have exactly four options.
    return _reward(sample, "ABCD")
