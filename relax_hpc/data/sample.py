"""`Sample`: one prompt + one sampled response and everything the roles add to it.

A sample is the row that travels from rollout to training. Roles fill its fields in order:
rollout (response, log-probs, weight version), reward (reward), advantages (advantage),
and the trainer reads them. Field names follow REFERENCE.md's data-bus fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from relax_hpc.media.items import PromptMedia


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

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.response_ids)
