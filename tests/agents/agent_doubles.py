"""Test doubles for the agent tests: a scripted engine, an environment, a generate function and
inline agents (the subprocess agent is in sync_agent.py, which imports no torch)."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Iterable

import torch

from relax_hpc.agents.env import BaseInteractionEnv, StepResult
from relax_hpc.engines.base import Generation, SamplingParams
from relax_hpc.models.tiny import build_tokenizer_json, CHAT_TEMPLATE, IM_END, PAD_TOKEN


def tiny_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(build_tokenizer_json()),
                                  eos_token=IM_END, pad_token=PAD_TOKEN, unk_token=PAD_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    return tok


class ScriptedEngine:
    """Answers each prompt with the next text of `script` (cycled) then EOS, unless the budget
    cuts it; log-probs are distinct numbers so alignment errors show. Records every call."""

    def __init__(self, tokenizer: Any, script: list[str], version: int = 3) -> None:
        self.tok, self.script, self._version = tokenizer, script, version
        self.eos = int(tokenizer.eos_token_id)
        self.calls: list[tuple[list[list[int]], SamplingParams, int | None]] = []
        self.produced: list[Generation] = []
        self._next = 0
        self._lp = 0.0

    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._version = version

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[Generation]:
        self.calls.append(([list(p) for p in prompts], params, seed))
        out = []
        for p in prompts:
            text = self.script[self._next % len(self.script)]
            self._next += 1
            ids = self.tok.encode(text, add_special_tokens=False) + [self.eos]
            ids = ids[:params.max_new_tokens]
            finish = "stop" if ids[-1] == self.eos else "length"
            lps = []
            for _ in ids:
                self._lp -= 0.01
                lps.append(round(self._lp, 4))
            shown = ids[:-1] if finish == "stop" else ids
            gen = Generation(list(p), ids, lps, finish, self._version, self.tok.decode(shown))
            self.produced.append(gen)
            out.append(gen)
        return out


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
