"""The multi-turn environment loop: masks, log-prob alignment, termination reasons, batching."""

from __future__ import annotations

import asyncio

import pytest

from relax_hpc.agents.batcher import EngineBatcher
from relax_hpc.agents.config import agent_code_problems
from relax_hpc.agents.dotted import load_dotted
from relax_hpc.agents.multiturn import GenerateArgs, generate_with_env, observation_token_ids, run_generate
from relax_hpc.agents.service import AgenticRollout
from relax_hpc.data.dataset import PromptRow as Row
from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import SamplingParams
from relax_hpc.spec.schema import RolloutSpec
from agent_doubles import EchoEnv, ScriptedEngine, tiny_tokenizer

TOK = tiny_tokenizer()
EOS = int(TOK.eos_token_id)
PARAMS = SamplingParams(max_new_tokens=4, stop_token_ids=(EOS,))


def sample(prompt: str = "hi", label: str = "") -> Sample:
    return Sample(prompt_ids=TOK.encode(prompt, add_special_tokens=False), response_ids=[],
                  rollout_log_probs=[], weight_version=0, group_id=1, prompt_index=0,
                  label=label, prompt_text=prompt)


def run(script: list[str], n: int = 1, max_turns: int = 4, budget: int = 200,
        params: SamplingParams = PARAMS) -> tuple[list[Sample], ScriptedEngine]:
    engine = ScriptedEngine(TOK, script, version=3)
    limits = RolloutSpec(max_turns=max_turns, max_total_tokens=budget)
    args = GenerateArgs(EngineBatcher(engine), TOK, EchoEnv, limits, EOS)
    out = asyncio.run(run_generate(generate_with_env, args, [sample() for _ in range(n)], params, seed=7))
    return out, engine


def test_masks_and_logprobs_align_with_what_the_engine_produced() -> None:
    [s], engine = run(["ab", "end"])
    obs = observation_token_ids(TOK, {"role": "user", "content": "ok"}, EOS, after_stop=True)
    # "<|im_start|>user:ok<|im_end|><|im_start|>assistant:" = 1 + 5 + 2 + 1 + 1 + 10 tokens
    assert len(obs) == 20
    g1, g2 = engine.produced
    assert s.response_ids == g1.token_ids + obs + g2.token_ids
    assert s.loss_mask == [1] * 3 + [0] * 20 + [1] * 4
    assert s.rollout_log_probs == g1.logprobs + [0.0] * 20 + g2.logprobs
    # Every model token is trained, every observation token is not, and the engine saw the
    # whole context (prompt + turn 1 + observation) on turn 2.
    assert engine.calls[1][0][0] == s.prompt_ids + g1.token_ids + obs
    assert s.metadata["termination"] == "terminated" and s.finish_reason == "stop"
    assert s.metadata["turn_rewards"] == [2.0, 3.0] and s.metadata["env_reward"] == 5.0
    assert s.metadata["turns"][0]["info"] == {"seen": "ab"}
    assert s.weight_version == 3


def test_truncated_by_env() -> None:
    [s], _ = run(["x", "cut"])
    assert s.metadata["termination"] == "truncated" and s.metadata["num_turns"] == 2
    assert s.finish_reason == "length"


def test_max_turns_stops_without_a_trailing_observation() -> None:
    [s], engine = run(["a"], max_turns=3)
    assert s.metadata["termination"] == "max_turns" and len(engine.produced) == 3
    assert s.loss_mask[-2:] == [1, 1]  # ends on the model's turn ("a" + EOS), not an observation


def test_token_budget_caps_generation_and_observations() -> None:
    # Turn 1: 2 tokens, observation 20 -> 22 used; turn 2 may take only 3 of its 4 tokens.
    [s], engine = run(["a", "abc"], budget=25)
    assert engine.calls[1][1].max_new_tokens == 3
    assert len(s.response_ids) == 25 and s.metadata["termination"] == "token_budget"
    # A length-cut turn gets an end-of-turn token put before the next observation.
    obs = observation_token_ids(TOK, {"role": "user", "content": "ok"}, EOS, after_stop=False)
    assert obs[0] == EOS and obs[1:] == observation_token_ids(TOK, {"role": "user", "content": "ok"}, EOS, True)
    # An observation that would leave no room for a model turn is not appended.
    [s2], _ = run(["a"], budget=22)
    assert len(s2.response_ids) == 2 and s2.metadata["termination"] == "token_budget"


def test_all_active_episodes_generate_together_each_turn() -> None:
    # Episode k ends on turn 1 when the script gives it "end"; the others continue.
    out, engine = run(["end", "a", "a", "a", "end", "end"], n=4, max_turns=2)
    assert [len(c[0]) for c in engine.calls] == [4, 3]
    assert [c[2] for c in engine.calls] == [7, 8]  # seeds: the round's seed, then +1 per call
    assert [s.metadata["num_turns"] for s in out] == [1, 2, 2, 2]


def test_dotted_paths_load_and_fail_with_the_key_named() -> None:
    assert load_dotted("[rollout] env", "agent_doubles:EchoEnv") is EchoEnv
    with pytest.raises(ValueError, match=r"\[rollout\] env = \"no_such_mod:X\": cannot import module"):
        load_dotted("[rollout] env", "no_such_mod:X")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        load_dotted("[rollout] generate", "agent_doubles:Nope")
    with pytest.raises(ValueError, match="must be \"package.module:Name\""):
        load_dotted("[rollout] agent", "just_a_name")
    # Every path is imported and each one that fails is a problem of its key (the values' own
    # rules, such as agent with env, are the spec's: tests/cli/test_validate_agents.py).
    problems = agent_code_problems(RolloutSpec(env="bad_mod:E", generate="agent_doubles:Nope",
                                               agent="agent_doubles:ChatAgent"))
    assert [(p.key, p.value) for p in problems] == [("rollout.env", "'bad_mod:E'"),
                                                    ("rollout.generate", "'agent_doubles:Nope'")]
    assert "cannot import module" in problems[0].message and "has no attribute 'Nope'" in problems[1].message


def test_custom_generate_through_the_rollout_service() -> None:
    engine = ScriptedEngine(TOK, ["7", "1"], version=3)
    cfg = RolloutSpec(generate="agent_doubles:custom_generate")
    service = AgenticRollout(cfg, engine, TOK, PARAMS, EOS)
    try:
        rows = [Row(5, TOK.encode("q", add_special_tokens=False), "q", "7", {"k": 1})]
        groups, _ = service.generate_groups(rows, 2, seed=3, first_group_id=10)
    finally:
        service.close()
    [group] = groups
    assert [s.response_text for s in group] == ["7", "1"]
    assert [s.metadata["env_reward"] for s in group] == [1.0, 0.0]
    assert {s.group_id for s in group} == {10} and group[0].metadata["k"] == 1
    assert len(engine.calls) == 1 and len(engine.calls[0][0]) == 2  # both batched in one call
