"""Test doubles for the agent tests: environments, a generate function and inline agents (the
subprocess agent is in sync_agent.py, which imports no torch). The engine is the package's
in-memory twin, relax_hpc.engines.memory.ScriptedEngine (re-exported here)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from PIL import Image

from relax_hpc.agents.env import BaseInteractionEnv, StepResult
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.memory import ScriptedEngine

__all__ = ["ScriptedEngine", "tiny_tokenizer"]
from relax_hpc.models.tiny import build_tokenizer_json, CHAT_TEMPLATE, IM_END, PAD_TOKEN


def tiny_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(build_tokenizer_json()),
                                  eos_token=IM_END, pad_token=PAD_TOKEN, unk_token=PAD_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    return tok


class EchoEnv(BaseInteractionEnv):
    """Observes "ok" after each turn; terminates on "end", truncates on "cut" (async step)."""

    async def step(self, response_text: str) -> StepResult:
        await asyncio.sleep(0)
        reward = float(len(response_text))
        if response_text == "end":
            return StepResult(None, reward, terminated=True)
        if response_text == "cut":
            return StepResult(None, reward, truncated=True)
        return StepResult("ok", reward, info={"seen": response_text})


async def custom_generate(args: Any, sample: Any, sampling_params: SamplingParams) -> Any:
    gen = await args.engine.generate(sample.prompt_ids, sampling_params)
    sample.response_ids, sample.rollout_log_probs = gen.token_ids, gen.logprobs
    sample.response_text, sample.finish_reason = gen.text, gen.finish_reason
    sample.metadata["env_reward"] = 1.0 if gen.text == sample.label else 0.0
    return sample


class ChatAgent:
    """Inline agent: two turns through the OpenAI SDK; the reward is 1 for the last completion."""

    async def run(self, data: dict, **kw: Any) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"])
        msgs = list(data["messages"])
        first = await client.chat.completions.create(model="policy", messages=msgs)
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "again"}]
        second = await client.chat.completions.create(model="policy", messages=msgs)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["policy"]
        return 1.0 if second.choices[0].message.content else 0.0


class DictRewardAgent:
    """Inline agent that rewards its first completion only, by id."""

    async def run(self, data: dict, **kw: Any) -> dict:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"])
        a = await client.chat.completions.create(model="policy", messages=data["messages"])
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        return {a.id: 0.5}


class ImageEnv(BaseInteractionEnv):
    """Shows an image after each of the first two turns (a numpy array, then a PIL image, both
    seeded by the row's label), then ends."""

    def __init__(self, sample: Any) -> None:
        super().__init__(sample)
        self.turn = 0

    def step(self, response_text: str) -> StepResult:
        self.turn += 1
        if self.turn == 3:
            return StepResult(None, 1.0, terminated=True)
        pixels = observation_image(int(self.sample.label), self.turn)
        image = pixels if self.turn == 1 else Image.fromarray(pixels)
        return StepResult([image, f"and {self.turn}?"], 0.0)


def observation_image(seed: int, turn: int) -> np.ndarray:
    return np.random.default_rng([seed, turn]).integers(0, 256, (40, 56, 3), dtype=np.uint8)


class MediaChatAgent:
    """Inline agent, two turns: an image, an audio clip and text, then a second image with the
    conversation so far re-sent. The data URLs and the base64 WAV are in the row's metadata."""

    async def run(self, data: dict, **kw: Any) -> float:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"])
        meta = data["metadata"]
        msgs: list[dict[str, Any]] = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": meta["images"][0]}},
            {"type": "input_audio", "input_audio": {"data": meta["audio"], "format": "wav"}},
            {"type": "text", "text": "what?"},
        ]}]
        first = await client.chat.completions.create(model="policy", messages=msgs)
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": [{"type": "image_url", "image_url": {"url": meta["images"][1]}},
                                              {"type": "text", "text": "and this?"}]}]
        await client.chat.completions.create(model="policy", messages=msgs)
        return 1.0


class ForwardedMessagesAgent:
    """Inline agent, one turn: sends `data["messages"]` as it got them. Keeps each one's copy."""

    messages: list[list[dict[str, Any]]] = []

    async def run(self, data: dict, **kw: Any) -> float:
        from openai import AsyncOpenAI

        ForwardedMessagesAgent.messages.append(data["messages"])
        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"])
        await client.chat.completions.create(model="policy", messages=data["messages"])
        return 1.0


class OfferedMediaAgent:
    """Inline agent, two turns: the row's media parts as it was offered them, then text, then the
    conversation so far re-sent with one more user turn. Keeps every `data["media_parts"]` it got."""

    offered: list[list[dict[str, Any]]] = []

    async def run(self, data: dict, **kw: Any) -> float:
        from openai import AsyncOpenAI

        OfferedMediaAgent.offered.append(data["media_parts"])
        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"])
        msgs: list[dict[str, Any]] = [{"role": "user", "content": [*data["media_parts"],
                                                                   {"type": "text", "text": "what?"}]}]
        first = await client.chat.completions.create(model="policy", messages=msgs)
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
        await client.chat.completions.create(model="policy", messages=msgs)
        return 1.0
