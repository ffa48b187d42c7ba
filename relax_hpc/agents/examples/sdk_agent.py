"""A tool-calling agent written only against the OpenAI Agents SDK (`pip install relax-hpc[agents]`).

`Runner.run` drives it through the proxy's Responses API (`POST /v1/responses`), the SDK's default
model: the agent asks, calls `lookup` when the model writes the call, sends the result back and
reads the answer. The task and its reward are in tool_model.py; jobspecs/agent_tools_sdk.toml
trains it. Tracing is off: it would send traces to OpenAI's servers, which a job cannot reach.
"""

from __future__ import annotations

from typing import Any

from agents import Agent, RunConfig, Runner, function_tool, set_tracing_disabled
from agents.exceptions import AgentsException
from agents.models.openai_provider import OpenAIProvider
from openai import AsyncOpenAI

from relax_hpc.agents.examples.tool_model import box_reward

set_tracing_disabled(True)


class BoxAgent:
    async def run(self, data: dict[str, Any], **kw: Any) -> float:
        label, calls = str(data["label"]), []

        @function_tool
        def lookup() -> str:
            """What is in the box the question asks about."""
            calls.append(label)
            return label

        agent = Agent(name="boxes", instructions="answer", model="policy", tools=[lookup])
        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw["http_client"],
                             max_retries=0)
        config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
        try:
            result = await Runner.run(agent, data["prompt"], run_config=config, max_turns=3)
        except AgentsException:  # a reply cut at the token limit (status "incomplete"), or too many turns
            return box_reward(bool(calls), None, label)
        return box_reward(bool(calls), str(result.final_output), label)
