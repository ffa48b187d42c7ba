"""Rollout's per-media reward means: which media a multimodal policy has learnt to use."""

from __future__ import annotations

import numpy as np

from relax_hpc.data.sample import Sample
from relax_hpc.media.items import MediaItem, PromptMedia
from relax_hpc.roles.rollout import reward_by_media

IMAGE = MediaItem("image", np.zeros((16, 16, 3), np.uint8))
AUDIO = MediaItem("audio", np.zeros(800, np.float32), 16000.0)


def _sample(media: PromptMedia, reward: float) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[2], rollout_log_probs=[0.0], weight_version=0, group_id=0,
                  prompt_index=0, reward=reward, media=media)


def test_rewards_are_averaged_per_kind_of_prompt_media() -> None:
    samples = [_sample(PromptMedia((IMAGE,)), 1.0), _sample(PromptMedia((IMAGE,)), 0.0),
               _sample(PromptMedia((AUDIO,)), 1.0), _sample(PromptMedia((IMAGE, AUDIO)), 0.5),
               _sample(PromptMedia(), 0.25)]
    assert reward_by_media(samples) == {
        "reward/by_media/audio": 1.0, "reward/by_media/image": 0.5, "reward/by_media/image+audio": 0.5,
        "reward/by_media/text": 0.25,
    }
