"""Math rewards (math, dapo, deepscaler) and answer extraction on real-looking responses."""

from __future__ import annotations

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.extract import after_thinking, answer_line, answer_tag, last_boxed
from relax_hpc.rewards.math_answer import dapo_reward, deepscaler_reward, math_equal, math_reward


def _sample(text: str, label: object) -> Sample:
    return Sample([1], [2], [-1.0], 0, group_id=0, prompt_index=0, label=label, response_text=text)


def test_last_boxed_is_balanced_and_last() -> None:
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed {7}") == "7"
    assert last_boxed(r"\fbox{x+1}") == "x+1"
    assert last_boxed("no box here") is None
    assert last_boxed(r"\boxed{\frac{1}{2}") is None  # unbalanced: no answer, no exception
    assert last_boxed(r"\boxed{3} and a broken \boxed{4") == "3"  # falls back to the last balanced one
    assert last_boxed("\x08oxed{5}") == "5"  # "\boxed" written in a non-raw Python string


def test_other_extractors() -> None:
    assert answer_line("work...\nAnswer: 42\n") == "42"
    assert answer_line("answer:   $x=3$") == "$x=3$"
    assert answer_line("Answer:\n") is None
    assert answer_tag("<answer> B </answer> and <answer>C</answer>") == "C"
    assert after_thinking("<think>hmm</think> final") == " final"
    assert after_thinking("still thinking") is None


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("0.5", "1/2"),
        (r"\frac{1}{2}", "0.5"),
        (r"\dfrac{1}{2}", r"\frac12"),
        ("1/2", r"\boxed{\frac{1}{2}}"),  # label given boxed
        ("5 cm", "5"),
        (r"5\text{ cm}", "5"),
        ("1,000", "1000"),
        ("12.0", "12"),
        ("(x+1)^2", "x^2+2x+1"),
        (r"\{1,2\}", r"\{2,1\}"),
        (r"\pi/2", r"\frac{\pi}{2}"),
        ("$34$", "34"),
    ],
)
def test_equivalent_forms(pred: str, gold: str) -> None:
    assert math_equal(pred, gold)


@pytest.mark.parametrize(("pred", "gold"), [("3", "4"), ("0.51", "1/2"), ("x+1", "x-1"), ("", "1"), ("abc", "5")])
def test_different_answers(pred: str, gold: str) -> None:
    assert not math_equal(pred, gold)


@pytest.mark.parametrize(
    ("text", "label", "score"),
    [
        (r"So the answer is $\boxed{\dfrac{1}{2}}$.", "0.5", 1.0),
        (r"The total is \boxed{1,000} apples.", "1000", 1.0),
        ("Thus\nAnswer: 5 cm", "5", 1.0),  # no box: the "Answer:" line counts
        (r"\boxed{3}", "4", 0.0),
        ("I think it is 7.", "7", 0.0),  # no boxed answer, no Answer: line
        (r"\boxed{\frac{1}{2}", "0.5", 0.0),  # unbalanced braces
        (r"\boxed{8}", ["7", "8"], 1.0),  # any of several labels
        (r"\boxed{8}", None, 0.0),
    ],
)
def test_math_reward(text: str, label: object, score: float) -> None:
    assert math_reward(_sample(text, label))["score"] == score


def test_huge_response_scores_without_stalling() -> None:
    junk = "{" * 50_000 + "x" * 50_000  # 100 kB, unbalanced braces everywhere
    assert math_reward(_sample(junk, "1"))["score"] == 0.0
    assert math_reward(_sample(junk + r" \boxed{1}", "1"))["score"] == 1.0  # the tail still counts
    assert dapo_reward(_sample(junk, "1"))["score"] == -1.0
    assert deepscaler_reward(_sample(junk, "1"))["score"] == 0.0


def test_dapo_reward_is_plus_minus_one_on_the_answer_line() -> None:
    good = "Let me compute. 17 + 17 = 34.\nAnswer: 34"
    assert dapo_reward(_sample(good, "34")) == {"score": 1.0, "acc": 1.0, "has_answer": 1.0, "too_large": 0.0}
    assert dapo_reward(_sample("Answer: 35", "34"))["score"] == -1.0
    assert dapo_reward(_sample(r"\boxed{34}", "34")) == {"score": -1.0, "acc": 0.0, "has_answer": 0.0, "too_large": 0.0}
    # DAPO reads the last 300 characters only: an early answer followed by a long tail is lost.
    assert dapo_reward(_sample("Answer: 34\n" + "z" * 400, "34"))["score"] == -1.0


def test_deepscaler_needs_the_thinking_to_end() -> None:
    label = r"\frac{3}{4}"
    assert deepscaler_reward(_sample(r"<think>0.7?</think> so \boxed{0.75}", label))["score"] == 1.0
    assert deepscaler_reward(_sample(r"###Response \boxed{3/4}", label))["score"] == 1.0
    assert deepscaler_reward(_sample(r"\boxed{0.75}", label))["score"] == 0.0  # no </think>
    assert deepscaler_reward(_sample(r"<think>\boxed{0.75}</think> none", label))["score"] == 0.0


@pytest.mark.timeout(120)  # a hard guard only: the quadratic versions took minutes here
def test_extractors_on_adversarial_responses_give_the_same_answers() -> None:
    # Runs of unclosed markers, each of which used to be scanned to the end of the text.
    assert last_boxed("\\boxed{" * 50_000) is None
    assert last_boxed("\\boxed{" * 50_000 + "\\boxed{7}") == "7"
    assert last_boxed("\\boxed{1}" + "{" * 100_000) == "1"
    assert answer_tag("<answer>" * 50_000) is None
    assert answer_tag("<answer>x <answer>y</answer>" + "<answer>" * 50_000) == "x <answer>y"  # as a lazy regex pairs them
    assert answer_line(("answer" + " " * 40) * 5_000) is None


@pytest.mark.timeout(120)
def test_choice_phrase_on_long_blank_runs() -> None:
    from relax_hpc.rewards.choice import choice_letter

    assert choice_letter(("answer is" + " \t" * 100) * 40) is None
    assert choice_letter("answer is" + " " * 3000 + "(B)") == "B"
