"""Session export: reward assignment with turn discount, individual and concat samples, and the
media each sample keeps."""

from __future__ import annotations

import numpy as np
import pytest

from relax_hpc.agents.export import (
    CompletionRecord, assign_rewards, export_concat, export_individual,
)
from relax_hpc.media.items import MediaItem, PromptMedia


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


def _image(value: int) -> MediaItem:
    return MediaItem("image", np.full((16, 16, 3), value, dtype=np.uint8))


def test_media_follow_their_samples_and_a_swapped_image_breaks_the_chain() -> None:
    a, b, c = _image(1), _image(2), _image(3)
    audio = MediaItem("audio", np.zeros(400, dtype=np.float32), rate=16000)
    t1 = CompletionRecord("a", [1, 2], [3], [-0.5], "stop", 2, "t", PromptMedia((a, audio)))
    t2 = CompletionRecord("b", [1, 2, 3, 7], [9], [-0.5], "stop", 2, "t", PromptMedia((a, b, audio)))
    [s] = export_concat([t1, t2], [0.0, 1.0])
    assert s.media == t2.media and s.completion_ids == ["a", "b"]  # the chain's last completion's media
    assert [x.media for x in export_individual([t1, t2], [0.0, 1.0])] == [t1.media, t2.media]
    # Same token ids, but the first image is another one of its size: the earlier tokens would
    # be trained against the wrong pixels, so the second completion starts its own sample.
    swapped = CompletionRecord("b", [1, 2, 3, 7], [9], [-0.5], "stop", 2, "t", PromptMedia((c, b, audio)))
    assert [x.media for x in export_concat([t1, swapped], [0.0, 1.0])] == [t1.media, swapped.media]
    # A text model's records carry no media and chain as before.
    assert [x.media for x in export_concat([rec("a", [1], [2]), rec("b", [1, 2, 5], [6])], [0.0, 1.0])] == [None]
