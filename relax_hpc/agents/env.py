"""The interaction-environment interface that multi-turn rollouts talk to.

An environment is created once per episode (one sampled trajectory) with the `Sample` it belongs
to, so it can read the prompt, the label and the dataset row's metadata. The rollout loop then
calls `reset()` once and `step(response_text)` after every model turn. `step` may be a plain
method or a coroutine (an environment that calls a remote tool can await it).

    class MyEnv(BaseInteractionEnv):
        def __init__(self, sample: Sample) -> None:
            self.answer = str(sample.label)

        def step(self, response_text: str) -> StepResult:
            done = response_text == self.answer
            return StepResult(observation=None if done else "try again",
                               reward=float(done), terminated=done)

A plain 5-tuple `(observation, reward, terminated, truncated, info)` is accepted from `step`
as well, as in Gymnasium.

An observation is text, or, for a multimodal model, a list of parts shown in one message: `str`
text, images as RGB uint8 (H, W, 3) numpy arrays or PIL images, and `MediaItem`s (image, video,
audio); a lone image counts as a one-part list:

    return StepResult([board_png_array, "your move?"], reward=0.0)
"""

from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass, field
from typing import Any, Awaitable, NamedTuple

from relax_hpc.agents.media import is_media_value
from relax_hpc.data.sample import Sample

ChatMessage = dict[str, Any]


class StepResult(NamedTuple):
    """What the environment answers to one model turn (Gymnasium's step tuple)."""

    observation: Any = None  # None, "" or []: nothing is shown to the model
    reward: float = 0.0
    terminated: bool = False  # the task is over (solved or failed)
    truncated: bool = False  # the environment cut the episode short (its own limit)
    info: dict[str, Any] | None = None  # free-form; recorded per turn in the metadata


class BaseInteractionEnv(abc.ABC):
    """Base class of multi-turn environments: override `step`, and `reset` / `format_observation`
    when the defaults do not fit. Instances are never shared between episodes."""

    observation_role: str = "user"

    def __init__(self, sample: Sample) -> None:
        self.sample = sample

    def reset(self) -> Any:
        """Start the episode; a non-empty observation is appended to the prompt (not trained)."""
        return None

    @abc.abstractmethod
    def step(self, response_text: str) -> StepResult | tuple | Awaitable[StepResult | tuple]:
        """React to the model's latest turn (its text, the stop token left out); every env defines it."""

    def format_observation(self, observation: Any) -> ChatMessage:
        """The chat message an observation becomes; the chat template turns it into tokens. Text
        becomes a string content, a list of parts (or one medium) a list content."""
        if isinstance(observation, list):
            return {"role": self.observation_role, "content": list(observation)}
        if is_media_value(observation):
            return {"role": self.observation_role, "content": [observation]}
        return {"role": self.observation_role, "content": str(observation)}


@dataclass
class TurnRecord:
    """One model turn of an episode, kept in `sample.metadata["turns"]` as a dict."""

    text: str
    reward: float
    n_model_tokens: int
    n_observation_tokens: int
    info: dict[str, Any] = field(default_factory=dict)


async def maybe_await(value: Any) -> Any:
    """`value`, awaited if it is awaitable: lets environments be sync or async."""
    if inspect.isawaitable(value):
        return await value
    return value


def as_step_result(value: Any, env_name: str) -> StepResult:
    """Normalise what `step` returned; a wrong shape is an error that names the environment."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) == 5:
        obs, reward, terminated, truncated, info = value
        return StepResult(obs, float(reward), bool(terminated), bool(truncated), dict(info or {}))
    raise TypeError(
        f"{env_name}.step must return StepResult or a 5-tuple (observation, reward, terminated, "
        f"truncated, info), got {type(value).__name__}"
    )
