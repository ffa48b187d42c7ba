"""The cross-checks of [algorithm] advantage and DAPO's overlong shaping (relax_hpc/spec/cross_checks.py)."""

from __future__ import annotations

from typing import Any

from spec_example import spec_with

from relax_hpc.spec import SpecError, SpecProblem, parse_spec


def _problems(changes: dict[str, Any]) -> list[SpecProblem]:
    try:
        parse_spec(spec_with(changes))
    except SpecError as e:
        return list(e.problems)
    return []


def test_each_estimator_is_accepted() -> None:
    for estimator in ("group", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        assert parse_spec(spec_with({"algorithm": {"advantage": estimator}})).algorithm.advantage == estimator


def test_an_unknown_estimator_lists_the_allowed_ones() -> None:
    (problem,) = _problems({"algorithm": {"advantage": "ppo"}})
    assert problem.key == "algorithm.advantage" and "rloo" in problem.format("x.toml")


def test_group_estimators_need_two_samples_and_reinforce_pp_does_not() -> None:
    (problem,) = _problems({"rollout": {"n_samples_per_prompt": 1}, "algorithm": {"advantage": "rloo"}})
    assert problem.key == "rollout.n_samples_per_prompt"
    assert 'advantage = "rloo"' in problem.message and 'advantage = "reinforce_pp" needs no group' in problem.message
    assert _problems({"rollout": {"n_samples_per_prompt": 1}, "algorithm": {"advantage": "reinforce_pp"}}) == []


def test_reinforce_pp_refuses_a_kl_loss_and_says_what_to_do() -> None:
    (problem,) = _problems({"algorithm": {"advantage": "reinforce_pp", "kl_coef": 0.01}})
    assert problem.key == "algorithm.kl_coef"
    assert "set kl_coef = 0" in problem.message and "reinforce_pp_baseline" in problem.message
    assert _problems({"algorithm": {"advantage": "reinforce_pp_baseline", "kl_coef": 0.01}}) == []


def test_the_overlong_buffer_fits_in_max_new_tokens() -> None:
    (problem,) = _problems({"rollout": {"max_new_tokens": 16}, "algorithm": {"overlong_buffer_len": 17}})
    assert problem.key == "algorithm.overlong_buffer_len" and "max_new_tokens = 16" in problem.message
    assert _problems({"rollout": {"max_new_tokens": 16}, "algorithm": {"overlong_buffer_len": 16}}) == []


def test_overlong_shaping_is_refused_for_multi_turn_episodes() -> None:
    (problem,) = _problems({"rollout": {"env": "relax_hpc.agents.examples:GuessEnv"},
                            "algorithm": {"overlong_filter": True}})
    assert problem.key == "algorithm.overlong_filter" and "multi-turn" in problem.message
