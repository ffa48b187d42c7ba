"""Multi-turn rollouts: the environment loop and the custom-generate hook.

`[rollout] generate = "module:function"` names a coroutine

    async def generate(args: GenerateArgs, sample: Sample, sampling_params: SamplingParams) -> Sample

that fills in one sample's response (`response_ids`, `rollout_log_probs`, `loss_mask`,
`response_text`, `finish_reason`, `weight_version`, and anything in `metadata`). `args` is a
`GenerateArgs`: the batched engine (`await args.engine.generate(prompt_ids, params,
media=sample.media)`), the tokenizer, the environment class from `[rollout] env` (or None), the
`[rollout]` table (whose turn and token limits `args.max_turns` and `args.max_total_tokens` read)
and, for a multimodal model, its media processor. With only
`[rollout] env` set, `generate_with_env` below is the generate function.

All samples of a step run concurrently on one event loop; their engine calls are batched, so
the active episodes of a turn are decoded together.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable

from relax_hpc.agents.batcher import EngineBatcher
from relax_hpc.agents.env import BaseInteractionEnv, TurnRecord, as_step_result, maybe_await
from relax_hpc.agents.media import observation_parts, prompt_media
from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import SamplingParams
from relax_hpc.media.items import MediaItem, PromptMedia
from relax_hpc.spec.schema import RolloutSpec

GenerateFn = Callable[["GenerateArgs", Sample, SamplingParams], Awaitable[Sample]]

# Why an episode ended (sample.metadata["termination"]).
TERMINATED, TRUNCATED, MAX_TURNS, TOKEN_BUDGET = "terminated", "truncated", "max_turns", "token_budget"


@dataclass
class GenerateArgs:
    """What a generate function is given besides the sample (the `args` of docs/agents.md).

    `rollout` is the job's [rollout] table itself; `max_turns` and `max_total_tokens` read it."""

    engine: EngineBatcher
    tokenizer: Any  # a Hugging Face tokenizer with a chat template
    env_class: type[BaseInteractionEnv] | None
    rollout: RolloutSpec
    eos_id: int
    media_processor: Any = None  # relax_hpc.media.processor.MediaProcessor; None: a text model

    @property
    def max_turns(self) -> int:
        """[rollout] max_turns: model turns per episode."""
        return self.rollout.max_turns

    @property
    def max_total_tokens(self) -> int:
        """[rollout] max_total_tokens: budget of response tokens, model and observation tokens together."""
        return self.rollout.max_total_tokens


def observation_tokens(tokenizer: Any, message: dict[str, Any], eos_id: int, after_stop: bool,
                       processor: Any = None) -> tuple[list[int], list[MediaItem]]:
    """Tokens of one observation message, ending with the next assistant header, and its media.

    The content is a string, or a list of parts (`relax_hpc.agents.media.observation_parts`):
    text, and images or audio, whose placeholders come back expanded. When the model's turn was
    cut by the length limit it did not close its turn; an end-of-turn token is put first so the
    context still reads as a well-formed chat.
    """
    content = message.get("content")
    items: list[MediaItem] = []
    if isinstance(content, list):
        parts, items = observation_parts(content, processor)
        message = {**message, "content": parts if items else "".join(p["text"] for p in parts)}
    elif not isinstance(content, str):
        raise TypeError(
            f"format_observation must return a message whose content is a string or a list of parts "
            f"(text, images, audio), got {type(content).__name__}"
        )
    text = tokenizer.apply_chat_template([message], add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if items:
        ids = processor.expand(ids, prompt_media(items))
    return (ids if after_stop else [eos_id, *ids]), items


def observation_token_ids(tokenizer: Any, message: dict[str, Any], eos_id: int, after_stop: bool) -> list[int]:
    """The tokens of a text observation message (`observation_tokens` without media)."""
    return observation_tokens(tokenizer, message, eos_id, after_stop)[0]


def _no_observation(observation: Any) -> bool:
    return observation is None or (isinstance(observation, (str, list)) and not observation)


async def generate_with_env(args: GenerateArgs, sample: Sample, sampling_params: SamplingParams) -> Sample:
    """Run one episode of `args.env_class` and write the trajectory into `sample`.

    Model tokens get loss mask 1 and their log-probs; observation tokens mask 0 and log-prob 0.
    Media of observations join the sample's media (`sample.media`; None for a text model), and
    every turn's engine call carries all of them. Stops when the environment terminates or
    truncates, after `max_turns` model turns, or when the response reaches `max_total_tokens`.
    """
    if args.env_class is None:
        raise ValueError("generate_with_env needs [rollout] env = \"module:Class\"")
    env = args.env_class(sample)
    env_name = type(env).__name__
    ids: list[int] = []
    logps: list[float] = []
    mask: list[int] = []
    turns: list[TurnRecord] = []
    first = await maybe_await(env.reset())
    prompt = list(sample.prompt_ids)
    media = list(sample.media.items) if sample.media is not None else None  # None: a text model
    if not _no_observation(first):
        obs, obs_media = observation_tokens(args.tokenizer, env.format_observation(first), args.eos_id, True,
                                            args.media_processor)
        prompt += obs
        media = _joined(media, obs_media)
    reason, version = MAX_TURNS, sample.weight_version
    while True:
        room = args.max_total_tokens - len(ids)
        if room <= 0:
            reason = TOKEN_BUDGET
            break
        params = sampling_params
        if room < params.max_new_tokens:
            params = SamplingParams(**{**params.__dict__, "max_new_tokens": room})
        gen = await args.engine.generate(prompt + ids, params, session=id(sample),  # one engine per episode
                                         media=_prompt_media(media))
        version = gen.weight_version
        ids += gen.token_ids
        logps += gen.logprobs
        mask += [1] * len(gen.token_ids)
        result = as_step_result(await maybe_await(env.step(gen.text)), env_name)
        turn = TurnRecord(gen.text, float(result.reward), len(gen.token_ids), 0, dict(result.info or {}))
        turns.append(turn)
        if result.terminated or result.truncated:
            reason = TERMINATED if result.terminated else TRUNCATED
            break
        if len(turns) >= args.max_turns:
            reason = MAX_TURNS
            break
        if _no_observation(result.observation):
            continue  # nothing to show: the model simply takes another turn
        stopped = bool(gen.token_ids) and gen.token_ids[-1] == args.eos_id
        obs, obs_media = observation_tokens(args.tokenizer, env.format_observation(result.observation),
                                            args.eos_id, stopped, args.media_processor)
        if len(ids) + len(obs) >= args.max_total_tokens:
            # No room left for another model turn after this observation: an observation at the
            # end of a response would be trained on nothing, so it is left out.
            reason = TOKEN_BUDGET
            break
        ids += obs
        media = _joined(media, obs_media)
        logps += [0.0] * len(obs)
        mask += [0] * len(obs)
        turn.n_observation_tokens = len(obs)
    sample.prompt_ids, sample.media = prompt, _prompt_media(media)
    sample.response_ids, sample.rollout_log_probs, sample.loss_mask = ids, logps, mask
    sample.weight_version = version
    sample.response_text = args.tokenizer.decode(ids, skip_special_tokens=False)
    sample.finish_reason = "stop" if reason == TERMINATED else "length"
    rewards = [t.reward for t in turns]
    sample.metadata.update({
        "termination": reason, "turn_rewards": rewards, "env_reward": sum(rewards),
        "turns": [asdict(t) for t in turns], "num_turns": len(turns),
    })
    return sample


def _joined(media: list[MediaItem] | None, new: list[MediaItem]) -> list[MediaItem] | None:
    return [*(media or []), *new] if media is not None or new else None


def _prompt_media(media: list[MediaItem] | None) -> PromptMedia | None:
    return None if media is None else prompt_media(media)


async def run_generate(fn: GenerateFn, args: GenerateArgs, samples: list[Sample],
                       params: SamplingParams, seed: int) -> list[Sample]:
    """Run `fn` for every sample concurrently, batching their engine calls; returns the samples."""
    args.engine.begin(len(samples), seed)

    async def one(sample: Sample) -> Sample:
        try:
            out = await fn(args, sample, params)
        finally:
            args.engine.finish_one()
        if not isinstance(out, Sample):
            raise TypeError(f"the generate function must return the Sample, got {type(out).__name__}")
        return out

    return list(await asyncio.gather(*(one(s) for s in samples)))
