"""Multiple choice, GPQA, F1, IFBench-style checks and openr1mm on real-looking responses."""

from __future__ import annotations

from typing import Any

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.choice import choice_letter, gpqa_reward, multiple_choice_reward
from relax_hpc.rewards.f1 import f1_reward, token_f1
from relax_hpc.rewards.ifbench import ifbench_reward
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


def _if(text: str, ids: list[str], kwargs: list[dict[str, Any]]) -> dict[str, float]:
    return ifbench_reward(_sample(text, None, instruction_id_list=ids, kwargs=kwargs))


@pytest.mark.parametrize(
    ("instruction", "kwargs", "good", "bad"),
    [
        ("punctuation:no_comma", {}, "no commas here", "one, two"),
        ("change_case:english_lowercase", {}, "all lower", "Not lower"),
        ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{a: 1"),
        ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two", "* one\n* two\n- three"),
        ("length_constraints:number_words", {"relation": "at least", "num_words": 3}, "one two three", "one two"),
        ("length_constraints:number_words", {"relation": "less than", "num_words": 3}, "one two", "one two three"),
        ("keywords:existence", {"keywords": ["Paris", "river"]}, "paris has a river", "Paris only"),
        ("keywords:forbidden_words", {"forbidden_words": ["very"]}, "quite good", "Very good"),
        ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Done. Any other questions?", "Done."),
        ("detectable_format:title", {}, "<<My Title>>\ntext", "My Title"),
        ("startend:quotation", {}, '"quoted"', "plain"),
    ],
)
def test_ifbench_checks(instruction: str, kwargs: dict[str, Any], good: str, bad: str) -> None:
    assert _if(good, [instruction], [kwargs]) == {"score": 1.0, "followed_frac": 1.0}
    assert _if(bad, [instruction], [kwargs]) == {"score": 0.0, "followed_frac": 0.0}


def test_ifbench_all_must_hold_and_none_kwargs_from_parquet() -> None:
    ids = ["punctuation:no_comma", "change_case:english_lowercase"]
    # Parquet exports fill the kwargs other instructions use with None: they must be ignored.
    kwargs = [{"num_words": None}, {"relation": None}]
    assert _if("all lower, with a comma", ids, kwargs) == {"score": 0.0, "followed_frac": 0.5}
    assert _if("all lower no comma", ids, kwargs)["score"] == 1.0
    label = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    assert ifbench_reward(_sample("fine", label))["score"] == 1.0  # instructions in a dict label


def test_ifbench_bad_rows_raise_clearly() -> None:
    with pytest.raises(ValueError, match="unknown instruction id 'nope:x'; supported: .*punctuation:no_comma"):
        _if("x", ["nope:x"], [{}])
    with pytest.raises(ValueError, match="no 'instruction_id_list'.*metadata_keys"):
        ifbench_reward(_sample("x"))


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
