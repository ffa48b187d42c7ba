"""Answer extraction from model responses: last \\boxed{...}, "Answer: ...", <answer>...</answer>.

Every function here is pure, linear in the response length and never raises on malformed text
(unbalanced braces, no answer, megabytes of output): it returns None when there is no answer,
so reward functions can score that 0.
"""

from __future__ import annotations

import re

# Responses longer than this are judged on their tail only: a final answer sits at the end, and
# regex / sympy work on a 100 kB string is the stall a reward worker must not have.
MAX_TAIL_CHARS = 4096

_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def tail(text: str, chars: int = MAX_TAIL_CHARS) -> str:
    return text[-chars:] if len(text) > chars else text


def last_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} (or \\fbox{...}); None when there is none."""
    # A Python "\b" inside a non-raw string is a backspace; put the marker back before searching.
    text = text.replace("\x08", "\\b")
    for marker in ("\\boxed", "\\fbox"):
        start = text.rfind(marker)
        while start != -1:
            found = _balanced_after(text, start + len(marker))
            if found is not None:
                return found.strip()
            start = text.rfind(marker, 0, start)
    return None


def _balanced_after(text: str, pos: int) -> str | None:
    """The brace group starting at text[pos] (after optional spaces), or None if unbalanced."""
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if pos >= len(text) or text[pos] != "{":
        return None
    depth = 0
    for i in range(pos, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1 : i]
    return None


def answer_line(text: str, window: int = MAX_TAIL_CHARS) -> str | None:
    """The text after the last "Answer:" (case-insensitive) in the last `window` characters."""
    found = _ANSWER_LINE.findall(tail(text, window))
    if not found:
        return None
    value = found[-1].strip()
    return value or None


def answer_tag(text: str) -> str | None:
    """Content of the last <answer>...</answer>; None when absent."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def after_thinking(text: str) -> str | None:
    """The part after "</think>" (or "###Response"); None when the reasoning never ended."""
    if "</think>" in text:
        return text.split("</think>")[-1]
    if "###Response" in text:
        return text.split("###Response", 1)[1]
    return None
