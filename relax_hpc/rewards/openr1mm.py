"""`openr1mm`: the multimodal open-r1 reward: answers in <answer>...</answer>, math or exact match.

As in Relax: a response that repeats </think>, <answer> or </answer> (a reward hack that
multiplies the chances of a match) scores 0. Otherwise the answer (the <answer> content, else
the last \\boxed{} / "Answer:" line) matches the label's <answer> content (or the whole label)
by math equivalence or, failing that, exact string equality.
"""

from __future__ import annotations

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.extract import answer_tag, tail
from relax_hpc.rewards.math_answer import extract_math_answer, math_equal


def openr1mm_reward(sample: Sample) -> dict[str, float]:
    response = sample.response_text
    if any(response.count(tag) > 1 for tag in ("</think>", "<answer>", "</answer>")):
        return {"score": 0.0, "format_ok": 0.0}
    label = "" if sample.label is None else str(sample.label)
    gold = answer_tag(label)
    gold = gold if gold is not None else label.strip()
    pred = answer_tag(tail(response))
    if pred is None:
        pred = extract_math_answer(response)
    if pred is None or not gold:
        return {"score": 0.0, "format_ok": 1.0}
    correct = pred == gold or math_equal(pred, gold)
    return {"score": float(correct), "format_ok": 1.0}
