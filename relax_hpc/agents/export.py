"""Turn an agent session's recorded completions into training samples (pure functions).

A session is the list of completions the proxy served under one API key, in order. The agent's
result assigns rewards: a float is the reward of the last completion, a dict maps completion ids
to rewards. `assign_rewards` spreads them backwards with `turn_discount` (geometric): a
completion without its own reward gets `turn_discount` times the reward of the completion after
it. `export_individual` makes one sample per completion; `export_concat` makes one sample per
chain of completions in which each prompt extends the previous prompt and response (a normal
multi-turn chat), with the tokens between model turns masked out. A sample keeps its prompt's
media (a multimodal model): a chain's are its last completion's, which re-sent every earlier one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from relax_hpc.media.items import MEDIA_ORDER, PromptMedia


@dataclass
class CompletionRecord:
    """One chat completion the proxy served: exactly what the engine saw and produced."""

    completion_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    text: str
    media: PromptMedia | None = None  # the prompt's images / audios; None for a text model
    # The choice as the proxy served it ({"message": ..., "finish_reason": ...}: parsed tool
    # calls, finish reason "tool_calls"); None: the text as it is, with `finish_reason`.
    served: dict[str, Any] | None = None


@dataclass
class ExportedSample:
    """A training sample's token-level part; the rollout adds group, prompt index and label."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    reward: float
    weight_version: int
    finish_reason: str
    text: str
    completion_ids: list[str] = field(default_factory=list)
    media: PromptMedia | None = None


def assign_rewards(records: list[CompletionRecord], result: float | Mapping[str, float],
                   turn_discount: float) -> list[float]:
    """Reward of each completion, given the agent's result (see the module docstring)."""
    ids = [r.completion_id for r in records]
    if isinstance(result, Mapping):
        unknown = sorted(set(result) - set(ids))
        if unknown:
            raise ValueError(
                f"the agent's run() returned rewards for completion ids {unknown} that this session "
                f"did not make; its completions are {ids}"
            )
        explicit = {k: float(v) for k, v in result.items()}
    elif isinstance(result, (int, float)) and not isinstance(result, bool):
        explicit = {ids[-1]: float(result)} if ids else {}
    else:
        raise TypeError(
            f"the agent's run() must return a float or a dict {{completion_id: reward}}, got "
            f"{type(result).__name__}"
        )
    rewards = [0.0] * len(records)
    following: float | None = None  # reward of the next completion, if any has one
    for i in range(len(records) - 1, -1, -1):
        if ids[i] in explicit:
            rewards[i] = explicit[ids[i]]
        elif following is not None:
            rewards[i] = turn_discount * following
        following = rewards[i] if (ids[i] in explicit or following is not None) else None
    return rewards


def export_individual(records: list[CompletionRecord], rewards: list[float]) -> list[ExportedSample]:
    """One sample per completion: its prompt, its response, all response tokens trained."""
    return [
        ExportedSample(r.prompt_ids, r.response_ids, r.logprobs, [1] * len(r.response_ids), w,
                       r.weight_version, r.finish_reason, r.text, [r.completion_id], r.media)
        for r, w in zip(records, rewards)
    ]


def export_concat(records: list[CompletionRecord], rewards: list[float]) -> list[ExportedSample]:
    """One sample per chain: model tokens trained, the tokens between them (tool results, user
    turns, chat headers) masked with log-prob 0. The reward is the chain's last completion's."""
    out: list[ExportedSample] = []
    for r, w in zip(records, rewards):
        cur = out[-1] if out else None
        context = cur.prompt_ids + cur.response_ids if cur else None
        if (cur is None or context is None or r.prompt_ids[:len(context)] != context
                or not _media_extends(cur.media, r.media)):
            out.append(ExportedSample(list(r.prompt_ids), list(r.response_ids), list(r.logprobs),
                                      [1] * len(r.response_ids), w, r.weight_version,
                                      r.finish_reason, r.text, [r.completion_id], r.media))
            continue
        between = r.prompt_ids[len(context):]
        cur.response_ids += between + r.response_ids
        cur.logprobs += [0.0] * len(between) + r.logprobs
        cur.loss_mask += [0] * len(between) + [1] * len(r.response_ids)
        cur.reward, cur.weight_version = w, r.weight_version
        cur.finish_reason, cur.text = r.finish_reason, r.text
        cur.completion_ids.append(r.completion_id)
        cur.media = r.media
    return out


def _media_extends(before: PromptMedia | None, after: PromptMedia | None) -> bool:
    """Whether `after` holds `before`'s items first, kind by kind. Equal token ids are not enough:
    an image swapped for another of the same size keeps the ids and changes what they mean."""
    if before is None or after is None:
        return before is None and after is None
    return all(after.of(kind)[:len(before.of(kind))] == before.of(kind) for kind in MEDIA_ORDER)


def session_metadata(records: list[CompletionRecord], rewards: list[float]) -> dict[str, Any]:
    return {"num_completions": len(records), "completion_rewards": list(rewards)}
