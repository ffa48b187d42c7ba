"""`f1`: SQuAD-style token F1 between the response's answer and the label (best over labels).

Both sides are normalised the SQuAD way (lower case, punctuation and the articles a/an/the
removed, whitespace collapsed). The answer is the last <answer>...</answer> or "Answer:" line
when present, else the whole (tail of the) response.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.extract import answer_line, answer_tag, tail
from relax_hpc.rewards.registry import inline_reward

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def squad_normalize(text: str) -> str:
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def token_f1(prediction: str, truth: str) -> tuple[float, float, float]:
    """(f1, precision, recall) of the normalised token bags."""
    pred, gold = squad_normalize(prediction).split(), squad_normalize(truth).split()
    if not pred or not gold:
        same = float(pred == gold)
        return same, same, same
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0, 0.0, 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall), precision, recall


def _truths(label: Any) -> list[str]:
    if isinstance(label, dict) and "text" in label:  # SQuAD's {"text": [...], "answer_start": [...]}
        label = label["text"]
    if isinstance(label, (list, tuple)):
        return [str(x) for x in label]
    return [] if label is None else [str(label)]


@inline_reward
def f1_reward(sample: Sample) -> dict[str, float]:
    text = tail(sample.response_text)
    answer = answer_tag(text) or answer_line(text) or text
    best = (0.0, 0.0, 0.0)
    for truth in _truths(sample.label):
        best = max(best, token_f1(answer, truth))
    return {"score": best[0], "precision": best[1], "recall": best[2]}
