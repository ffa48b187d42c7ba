"""The [critic] table and the keys of advantage = "gae", and their cross-checks (spec/cross_checks.py)."""

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


def test_gae_with_a_critic_is_accepted_with_its_defaults() -> None:
    spec = parse_spec(spec_with({"algorithm": {"advantage": "gae", "gamma": 0.99, "lam": 0.95}, "critic": {}}))
    assert spec.algorithm.advantage == "gae" and (spec.algorithm.gamma, spec.algorithm.lam) == (0.99, 0.95)
    assert spec.algorithm.value_clip_eps == 0.5
    assert spec.critic is not None and spec.critic.model_path is None and spec.critic.lr == 1e-5
    assert parse_spec(spec_with({})).critic is None


def test_gae_without_a_critic_and_a_critic_without_gae_are_refused() -> None:
    (problem,) = _problems({"algorithm": {"advantage": "gae"}})
    assert problem.key == "algorithm.advantage" and "[critic]" in problem.message
    (problem,) = _problems({"critic": {"lr": 1e-5}})
    assert problem.key == "critic" and 'advantage = "gae"' in problem.message and "remove" in problem.message


def test_gae_refuses_the_advantages_role_opd_and_a_warmup_as_long_as_the_run() -> None:
    problems = _problems({"algorithm": {"advantage": "gae", "name": "opd", "opd_teacher_path": "t"},
                          "train": {"advantages_role": True, "steps": 5}, "critic": {"warmup_steps": 5}})
    assert sorted(p.key for p in problems) == ["algorithm.name", "critic.warmup_steps", "train.advantages_role"]
    assert all("gae" in p.message or "warm-up" in p.message for p in problems)


def test_gae_needs_no_group_and_checks_its_ranges() -> None:
    assert _problems({"rollout": {"n_samples_per_prompt": 1}, "algorithm": {"advantage": "gae"}, "critic": {}}) == []
    problems = _problems({"algorithm": {"advantage": "gae", "gamma": 1.5, "value_clip_eps": 0.0},
                          "critic": {"lr": 0.0, "bogus": 1}})
    assert sorted(p.key for p in problems) == ["algorithm.gamma", "algorithm.value_clip_eps", "critic.bogus",
                                               "critic.lr"]


GAE = {"algorithm": {"advantage": "gae"}}
CUDA_TRAINER = {"device": "cuda", "num_processes": 2}


def test_the_critic_ranks_default_to_one_following_the_trainer_strategy() -> None:
    spec = parse_spec(spec_with({**GAE, "critic": {}}))
    assert spec.critic is not None and (spec.critic.num_processes, spec.critic.strategy) == (1, None)
    spec = parse_spec(spec_with({**GAE, "critic": {"num_processes": 2, "strategy": "fsdp2"}}))
    assert spec.critic is not None and (spec.critic.num_processes, spec.critic.strategy) == (2, "fsdp2")
    (problem,) = _problems({**GAE, "critic": {"strategy": "zero3"}})
    assert problem.key == "critic.strategy" and "fsdp2" in str(problem.allowed)


def test_critic_ranks_on_gpus_need_gpus_of_their_own() -> None:
    # 4 GPUs on the trainer's component: 2 trainer ranks + 2 critic ranks fit, 3 critic ranks do not.
    cluster = {"trainer": {"nodes": 1, "gpus_per_node": 4}}
    fits = {**GAE, "train": CUDA_TRAINER, "cluster": cluster, "critic": {"num_processes": 2}}
    assert _problems(fits) == []
    (problem,) = _problems({**fits, "critic": {"num_processes": 3}})
    assert problem.key == "critic.num_processes" and problem.value == "3"
    assert "beside train.num_processes = 2" in problem.message and "[cluster.forward]" in problem.message
    # With a forward component the critic ranks go there, whatever the trainer takes.
    forward = {**cluster, "forward": {"nodes": 1, "gpus_per_node": 2}}
    assert _problems({**fits, "cluster": forward, "critic": {"num_processes": 2}}) == []
    (problem,) = _problems({**fits, "cluster": forward, "critic": {"num_processes": 3}})
    assert problem.key == "critic.num_processes" and "[cluster.forward]" in problem.message
    # On CPU no rank takes a GPU.
    assert _problems({**fits, "train": {"device": "cpu"}, "critic": {"num_processes": 8}}) == []
