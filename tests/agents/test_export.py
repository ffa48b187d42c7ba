"""Session export: reward assignment with turn discount, individual and concat samples."""

from __future__ import annotations

import pytest

from relax_hpc.agents.export import (
    CompletionRecord, assign_rewards, export_concat, export_individual,
)


def rec(cid: str, prompt: list[int], resp: list[int]) -> CompletionRecord:
    return CompletionRecord(cid, prompt, resp, [-0.5 - 0.1 * i for i in range(len(resp))], "stop", 2, "t")


THREE = [rec("a", [1], [2]), rec("b", [3], [4]), rec("c", [5], [6])]


def test_float_reward_goes_to_the_last_completion_and_is_discounted_backwards() -> None:
    # R = 1.0 at "c"; gamma = 0.5: b = 0.5 * 1.0 = 0.5, a = 0.5 * 0.5 = 0.25.
    assert assign_rewards(THREE, 1.0, 0.5) == [0.25, 0.5, 1.0]
    # gamma = 1.0 (the default) gives every turn the final reward.
    assert assign_rewards(THREE, 2.0, 1.0) == [2.0, 2.0, 2.0]


def test_dict_rewards_map_to_completion_ids() -> None:
    # "b" = 0.8 explicitly; "a" before it = 0.9 * 0.8 = 0.72; "c" after the last reward gets 0.
    assert assign_rewards(THREE, {"b": 0.8}, 0.9) == pytest.approx([0.72, 0.8, 0.0])
    # Both explicit: "a" keeps its own 0.1 rather than a discounted 0.9 * 1.0.
    assert assign_rewards(THREE, {"a": 0.1, "c": 1.0}, 0.9) == pytest.approx([0.1, 0.9, 1.0])
    with pytest.raises(ValueError, match=r"completion ids \['zzz'\]"):
        assign_rewards(THREE, {"zzz": 1.0}, 1.0)
    with pytest.raises(TypeError, match="float or a dict"):
        assign_rewards(THREE, "high", 1.0)  # type: ignore[arg-type]


def test_individual_export_is_one_sample_per_completion() -> None:
    out = export_individual(THREE, [0.25, 0.5, 1.0])
    assert [(s.prompt_ids, s.response_ids, s.reward) for s in out] == [([1], [2], 0.25), ([3], [4], 0.5), ([5], [6], 1.0)]
    assert all(s.loss_mask == [1] for s in out) and out[0].logprobs == [-0.5]


def test_concat_export_masks_the_tokens_between_model_turns() -> None:
    # Turn 2's prompt = turn 1's prompt + response + a user turn [7, 8]: one chained sample.
    t1 = rec("a", [1, 2], [3, 4])
    t2 = rec("b", [1, 2, 3, 4, 7, 8], [9])
    other = rec("c", [5], [6])  # a fresh conversation starts a new sample
    out = export_concat([t1, t2, other], [0.5, 1.0, 0.2])
    assert len(out) == 2
    s = out[0]
    assert s.prompt_ids == [1, 2] and s.response_ids == [3, 4, 7, 8, 9]
    assert s.loss_mask == [1, 1, 0, 0, 1]
    assert s.logprobs == [-0.5, -0.6, 0.0, 0.0, -0.5]
    assert s.reward == 1.0 and s.completion_ids == ["a", "b"]
    assert out[1].response_ids == [6] and out[1].reward == 0.2
