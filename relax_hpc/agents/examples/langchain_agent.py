"""A tool-calling agent written only against langchain-openai (`pip install relax-hpc[agents]`).

`ChatOpenAI(...).bind_tools([lookup])` talks to the proxy's `/v1/chat/completions` with native
tool calls: the agent asks, runs each call the model makes, sends the results back as tool
messages and reads the answer. The task and its reward are in tool_model.py;
jobspecs/agent_tools_langchain.toml trains it.
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from relax_hpc.agents.examples.tool_model import NEAR_MISS_REWARD, box_reward


class BoxAgent:
    async def run(self, data: dict[str, Any], **kw: Any) -> float:
        label = str(data["label"])

        @tool
        def lookup() -> str:
            """What is in the box the question asks about."""
            return label

        llm = ChatOpenAI(model="policy", base_url=kw["base_url"], api_key=kw["api_key"],
                         http_async_client=kw["http_client"], max_retries=0).bind_tools([lookup])
        messages: list[BaseMessage] = [HumanMessage(data["prompt"])]
        first = await llm.ainvoke(messages)
        if not first.tool_calls:
            return box_reward(False, str(first.content), label)
        if first.response_metadata.get("finish_reason") == "length":
            return NEAR_MISS_REWARD  # a call, then text cut at the token limit: the turn never ended
        messages.append(first)
        for call in first.tool_calls:
            messages.append(await lookup.ainvoke(call))  # a ToolCall in, a ToolMessage out
        final = await llm.ainvoke(messages)
        return box_reward(True, str(final.content), label)
