"""Multiple choice, GPQA, F1 and openr1mm on real-looking responses (ifbench: test_ifbench.py)."""

from __future__ import annotations

from typing import Any

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.choice import choice_letter, gpqa_reward, multiple_choice_reward
from relax_hpc.rewards.f1 import f1_reward, token_f1
from relax_hpc.rewards.openr1mm import openr1mm_reward


def _sample(text: str, label: Any = None, **metadata: Any) -> Sample:
    return Sample([1], [2], [-1.0], 0, group_id=0, prompt_index=0, label=label, response_text=text,
                  metadata=metadata)


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        ("<think>A or C?</think><answer>C</answer>", "C"),
        (r"Final: \boxed{B}", "B"),
        ("Therefore, the answer is (D).", "D"),
        ("Answer: a", None),  # lower case "a" is a word, not an option
        ("B", "B"),
        ("I cannot decide.", None),
    ],
)
def test_choice_letter(text: str, letter: str | None) -> None:
    assert choice_letter(text) == letter


def test_multiple_choice_reward_letter_and_text_labels() -> None:
    assert multiple_choice_reward(_sample("<answer>B</answer>", "<answer>B</answer>"))["score"] == 1.0
    assert multiple_choice_reward(_sample("<answer>B</answer>", "C"))["score"] == 0.0
    # AVQA-style label: the text of the right option, turned into its letter through "choices".
    row = {"choices": ["a dog barking", "a car horn", "rain"]}
    assert multiple_choice_reward(_sample("The answer is B", "a car horn", **row))["score"] == 1.0
    assert multiple_choice_reward(_sample("The answer is A", "a car horn", **row))["score"] == 0.0
    assert multiple_choice_reward(_sample("no idea", "B")) == {"score": 0.0, "has_answer": 0.0}


def test_gpqa_only_four_options() -> None:
    assert gpqa_reward(_sample("Answer: D", "D"))["score"] == 1.0
    assert gpqa_reward(_sample("Answer: E", "E"))["score"] == 0.0  # E is not a GPQA option
    assert gpqa_reward(_sample("x" * 100_000, "A"))["score"] == 0.0


def test_token_f1_hand_worked() -> None:
    # pred "the cat sat" -> [cat, sat]; gold "a cat sat down" -> [cat, sat, down]
    # common 2: precision 2/2, recall 2/3, F1 = 2*1*(2/3)/(1+2/3) = 0.8
    f1, precision, recall = token_f1("The cat sat!", "a cat sat down")
    assert (precision, recall) == (1.0, pytest.approx(2 / 3))
    assert f1 == pytest.approx(0.8)
    assert token_f1("", "") == (1.0, 1.0, 1.0)
    assert token_f1("dog", "cat") == (0.0, 0.0, 0.0)


def test_f1_reward_best_label_and_answer_extraction() -> None:
    sample = _sample("Thinking...\nAnswer: Denver Broncos", ["Broncos", "Denver Broncos"])
    assert f1_reward(sample)["score"] == 1.0
    squad = {"text": ["Santa Clara, California"], "answer_start": [403]}
    assert f1_reward(_sample("<answer>Santa Clara</answer>", squad))["score"] == pytest.approx(0.8)
    assert f1_reward(_sample("", "x"))["score"] == 0.0


@pytest.mark.parametrize(
    ("text", "label", "score"),
    [
        ("<think>area</think><answer>\\frac{1}{2}</answer>", "<answer> 0.5 </answer>", 1.0),
        ("<think>x</think><answer>cat</answer>", "<answer>cat</answer>", 1.0),  # exact match
        ("<think>x</think><answer>dog</answer>", "cat", 0.0),
        ("<answer>2</answer><answer>3</answer>", "<answer>3</answer>", 0.0),  # repeated tags: hack
        ("<think>a</think></think><answer>3</answer>", "3", 0.0),
        (r"no tags but \boxed{12}", "12", 1.0),
        ("nothing at all", "12", 0.0),
    ],
)
def test_openr1mm(text: str, label: str, score: float) -> None:
    assert openr1mm_reward(_sample(text, label))["score"] == score
