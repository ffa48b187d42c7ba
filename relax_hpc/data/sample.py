"""`Sample`: one prompt + one sampled response and everything the roles add to it.

A sample is the row that travels from rollout to training. Roles fill its fields in order:
rollout (response, log-probs, weight version, sample id), reward (reward), advantages
(advantage), and the trainer reads them. Field names follow REFERENCE.md's data-bus fields.

A sample id names a sample's slot in its step: (step, group position in the step, member in the
group), packed in one int64 so it travels as a queue scalar and an archive column
(`make_sample_id`; `relax-hpc inspect JOBDIR --check-exactly-once` checks that every slot was
trained exactly once, docs/archive.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from relax_hpc.media.items import PromptMedia
from relax_hpc.ops.sample_ids import (  # the id scheme lives with the archive that stores it
    NO_SAMPLE_ID,
    SAMPLE_ID_GROUPS,
    SAMPLE_ID_MAX_STEP,
    SAMPLE_ID_MEMBERS,
    format_sample_id,
    make_sample_id,
    split_sample_id,
)

__all__ = ["NO_SAMPLE_ID", "SAMPLE_ID_GROUPS", "SAMPLE_ID_MAX_STEP", "SAMPLE_ID_MEMBERS", "Sample",
           "assign_sample_ids", "format_sample_id", "make_sample_id", "split_sample_id"]


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    weight_version: int
    group_id: int  # samples of one prompt share a group id
    prompt_index: int  # row of the dataset the prompt came from
    label: Any = None
    prompt_text: str = ""
    response_text: str = ""
    finish_reason: str = "length"
    reward: float = 0.0  # the (possibly shaped) reward used for the advantage
    raw_reward: float = 0.0  # what the reward function returned as its score
    reward_info: dict[str, float] = field(default_factory=dict)
    advantage: float = 0.0
    loss_mask: list[int] | None = None  # None: every response token is trained
    old_log_probs: list[float] | None = None  # written by ActorFwd: the PPO "old" policy
    ref_log_probs: list[float] | None = None  # written by Reference: for the KL loss
    # Routing replay (R3): the experts the engine routed each fed token to, [P + R - 1, layers, top_k]
    routed_experts: torch.Tensor | None = None
    # The prompt's images / videos / audios (canonical, relax_hpc.media.items); None: a text model
    media: PromptMedia | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    sample_id: int = NO_SAMPLE_ID  # its slot in the step (make_sample_id), set by the rollout role

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.response_ids)


def assign_sample_ids(step: int, groups: Sequence[Sequence[Sample]]) -> None:
    """Number the samples of the groups a step trains on: group position, then member, from 0.

    Called once the step's groups are final (after dynamic sampling), so ids are dense; an
    agentic group may hold any number of samples, or none, and keeps its position.
    """
    for g, group in enumerate(groups):
        for m, sample in enumerate(group):
            sample.sample_id = make_sample_id(step, g, m)
