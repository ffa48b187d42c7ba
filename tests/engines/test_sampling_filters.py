"""Hand-worked cases for the pure sampling functions and the SamplingParams checks."""

from __future__ import annotations

import math

import pytest
import torch

from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.sampling import filter_top_k_top_p, sample_next

NEG_INF = float("-inf")

# softmax([2, 1, 0, -1]): e^2 = 7.389, e^1 = 2.718, e^0 = 1.000, e^-1 = 0.368, sum = 11.475
#   probs            = [0.6439, 0.2369, 0.0871, 0.0321]
#   mass ranked above = [0.0000, 0.6439, 0.8808, 0.9679]
# A token is dropped when the mass ranked above it is already >= top_p.
LOGITS = [2.0, 1.0, 0.0, -1.0]


def _kept(logits: list[float], top_k: int, top_p: float) -> list[bool]:
    out = filter_top_k_top_p(torch.tensor([logits]), top_k, top_p)[0]
    return [bool(v > NEG_INF) for v in out]


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (1.0, [True, True, True, True]),  # disabled
        (0.9, [True, True, True, False]),  # 0.8808 < 0.9 keeps token 2; 0.9679 >= 0.9 drops 3
        (0.7, [True, True, False, False]),  # 0.6439 < 0.7 keeps token 1; 0.8808 >= 0.7 drops 2
        (0.6, [True, False, False, False]),  # 0.6439 >= 0.6 drops token 1
        (0.01, [True, False, False, False]),  # the most likely token is always kept
    ],
)
def test_top_p_hand_cases(top_p: float, expected: list[bool]) -> None:
    assert _kept(LOGITS, 0, top_p) == expected


def test_top_p_works_on_unsorted_logits() -> None:
    # Same values as LOGITS, shuffled: [0, 2, -1, 1] -> tokens 1 (p .6439) and 3 (p .2369) kept.
    assert _kept([0.0, 2.0, -1.0, 1.0], 0, 0.7) == [False, True, False, True]


@pytest.mark.parametrize(
    ("top_k", "expected"),
    [
        (0, [True, True, True, True]),  # disabled
        (1, [True, False, False, False]),
        (2, [True, True, False, False]),
        (4, [True, True, True, True]),  # k == V
        (9, [True, True, True, True]),  # k > V
    ],
)
def test_top_k_hand_cases(top_k: int, expected: list[bool]) -> None:
    assert _kept(LOGITS, top_k, 1.0) == expected


def test_top_k_then_top_p_and_kept_logits_unchanged() -> None:
    # top_k = 3 leaves [2, 1, 0]; softmax of those: 7.389, 2.718, 1.000 over 11.107 =
    # [0.6652, 0.2447, 0.0900]; mass above = [0, 0.6652, 0.9100]; top_p = 0.9 drops token 2
    # (0.91 >= 0.9), although without top_k token 2 survives top_p = 0.9 (0.8808 < 0.9).
    out = filter_top_k_top_p(torch.tensor([LOGITS]), 3, 0.9)[0]
    assert out.tolist() == [2.0, 1.0, NEG_INF, NEG_INF]


def test_rows_are_filtered_independently() -> None:
    logits = torch.tensor([LOGITS, list(reversed(LOGITS))])
    out = filter_top_k_top_p(logits, 0, 0.7)
    assert (out > NEG_INF).tolist() == [[True, True, False, False], [False, False, True, True]]


def test_sample_next_log_prob_is_unfiltered_at_temperature() -> None:
    logits = torch.tensor([LOGITS, [0.0, 0.0, 5.0, 0.0]])
    tokens, logp = sample_next(logits, temperature=2.0, top_k=1, top_p=1.0, generator=None)
    assert tokens.tolist() == [0, 2]
    # Row 0: log_softmax([1, 0.5, 0, -0.5])[0] = 1 - log(e^1 + e^0.5 + e^0 + e^-0.5)
    expected0 = 1.0 - math.log(math.e + math.exp(0.5) + 1.0 + math.exp(-0.5))
    # Row 1: log_softmax([0, 0, 2.5, 0])[2] = 2.5 - log(3 + e^2.5)
    expected1 = 2.5 - math.log(3.0 + math.exp(2.5))
    assert logp.tolist() == pytest.approx([expected0, expected1], abs=1e-6)


def test_sample_next_never_picks_a_filtered_token() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([LOGITS] * 2000)
    tokens, _ = sample_next(logits, 1.0, 0, 0.7, generator)
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts[2] == counts[3] == 0
    # Renormalised over the two kept tokens: p0 = 0.6439 / 0.8808 = 0.731.
    assert counts[0] / 2000 == pytest.approx(0.731, abs=0.04)


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"max_new_tokens": 0}, "0"),
        ({"temperature": 0.0}, "0.0"),
        ({"temperature": -1.0}, "-1.0"),
        ({"temperature": float("nan")}, "nan"),
        ({"temperature": float("inf")}, "inf"),
        ({"top_p": 0.0}, "0.0"),
        ({"top_p": 1.5}, "1.5"),
        ({"top_k": -1}, "-1"),
    ],
)
def test_bad_sampling_params_name_the_value(kwargs: dict[str, float], shown: str) -> None:
    key = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"{key} must .*got {shown}$"):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
