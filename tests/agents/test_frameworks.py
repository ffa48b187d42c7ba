"""Agents written against the frameworks people use, run unchanged against the real proxy: the
Responses API through the official `openai` SDK and the OpenAI Agents SDK's default model, and
langchain-openai's `ChatOpenAI(...).bind_tools` on chat completions. The engine is scripted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from relax_hpc.agents.examples import langchain_agent, sdk_agent
from relax_hpc.agents.examples.tool_model import TOOL_CALL
from relax_hpc.agents.proxy import AgentProxy, proxy_token
from relax_hpc.agents.service import AgenticRollout
from relax_hpc.auth import JobSecret
from relax_hpc.data.dataset import PromptRow as Row
from relax_hpc.engines.base import SamplingParams
from relax_hpc.spec.schema import RolloutSpec
from agent_doubles import ScriptedEngine
from tool_agents import WEATHER_CALL, WEATHER_TOOL, load_tool_tokenizer

# The weather tool in the Responses API's form: flat, no "function" level.
RESPONSES_WEATHER = {"type": "function", **WEATHER_TOOL["function"], "strict": True}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tool_tokenizer(tmp_path_factory.mktemp("tool-tokenizer"))


@pytest.fixture
def proxy_of(tok: Any) -> Iterator[Callable[..., tuple[AgenticRollout, ScriptedEngine]]]:
    started: list[AgenticRollout] = []

    def start(script: list[str], agent: str = "tool_agents:ToolAgent", **cfg: Any
              ) -> tuple[AgenticRollout, ScriptedEngine]:
        engine = ScriptedEngine(tok, script, version=2)
        params = SamplingParams(max_new_tokens=200, stop_token_ids=(int(tok.eos_token_id),))
        svc = AgenticRollout(RolloutSpec(agent=agent, **cfg), engine, tok, params,  # type: ignore[arg-type]
                             int(tok.eos_token_id))
        started.append(svc)
        return svc, engine

    yield start
    for svc in started:
        svc.close()


def _client(svc: AgenticRollout) -> tuple[openai.OpenAI, AgentProxy, Any]:
    assert svc.proxy is not None
    session = svc.proxy.sessions.open()
    return openai.OpenAI(base_url=svc.proxy.base_url, api_key=session.api_key, max_retries=0), svc.proxy, session


def test_responses_api_two_turn_agent_with_a_function_call(proxy_of: Callable[..., Any], tok: Any) -> None:
    svc, engine = proxy_of([WEATHER_CALL, "sunny"])
    client, proxy, session = _client(svc)
    first = client.responses.create(model="policy", instructions="be brief", input="weather in paris?",
                                    tools=[RESPONSES_WEATHER])
    assert first.status == "completed" and first.id.startswith("resp_")
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "paris"}
    # The second turn names the first by previous_response_id and sends only the tool's output.
    final = client.responses.create(model="policy", previous_response_id=first.id, tools=[RESPONSES_WEATHER],
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": "18C"}])
    assert final.output_text == "sunny" and final.previous_response_id == first.id
    assert final.usage is not None and final.usage.output_tokens == len(engine.produced[1].token_ids)
    # The prompts are the chat path's: the instructions as the system turn, the call re-rendered
    # as the model wrote it, then the tool's result; previous instructions are not carried over.
    g1, g2 = engine.produced
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in paris?"}]
    assert g1.prompt_ids == tok.encode(tok.apply_chat_template(chat, tools=[WEATHER_TOOL], tokenize=False,
                                                               add_generation_prompt=True), add_special_tokens=False)
    assert "be brief" not in tok.decode(g2.prompt_ids)
    assert tok.decode(g2.prompt_ids).endswith(
        WEATHER_CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert [r.completion_id for r in session.completions] == [first.id, final.id]
    assert [r.response_ids for r in session.completions] == [g1.token_ids, g2.token_ids]
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id  # type: ignore[union-attr]
    # A response of another session is unknown here.
    other = openai.OpenAI(base_url=proxy.base_url, api_key=proxy.sessions.open().api_key, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        other.responses.create(model="policy", previous_response_id=first.id, input="and?")


def test_responses_api_refuses_what_it_cannot_serve_naming_the_field(proxy_of: Callable[..., Any]) -> None:
    svc, engine = proxy_of(["x"])
    client, proxy, _ = _client(svc)
    for kwargs, field in [
        ({"tools": [{**RESPONSES_WEATHER, "name": "has space"}]}, "tools[0].name = 'has space'"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type = 'web_search'"),
        ({"tools": [RESPONSES_WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"stream": True}, "stream = true"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type = 'reasoning'"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="policy", **{"input": "hi", **kwargs})
        assert err.value.status_code == 400 and field in err.value.message, (field, err.value.message)
    forged = JobSecret.generate().token("agent-proxy") + client.api_key[len(proxy_token()):]
    for key in ("sk-wrong", forged, f"{proxy_token()}.sk-relax-guessed"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=proxy.base_url, api_key=key, max_retries=0).responses.create(
                model="policy", input="hi")
    assert httpx.post(f"{proxy.base_url}/responses", json={"input": "hi"}, timeout=30).status_code == 401
    assert engine.produced == []


def test_openai_agents_sdk_runner_round_trips_a_tool_call(proxy_of: Callable[..., Any]) -> None:
    # The example agent, unchanged: Runner.run on the SDK's default (Responses) model.
    svc, engine = proxy_of([TOOL_CALL, "7"], agent="relax_hpc.agents.examples.sdk_agent:BoxAgent",
                           agent_export_style="concat")
    groups, stats = svc.generate_groups([Row(0, [], "what is in box a?", "7", {})], 1, seed=3, first_group_id=1)
    [[sample]] = groups
    assert sample.metadata["env_reward"] == pytest.approx(1.0) and len(engine.produced) == 2
    g1, g2 = engine.produced
    between = g2.prompt_ids[len(g1.prompt_ids) + len(g1.token_ids):]
    assert sample.response_ids == g1.token_ids + between + g2.token_ids
    assert sample.loss_mask == [1] * len(g1.token_ids) + [0] * len(between) + [1] * len(g2.token_ids)
    assert "<tool_response>\n7\n</tool_response>" in engine.tokenizer.decode(between)
    assert stats["agent/malformed_tool_calls"] == 0.0


def test_langchain_bind_tools_round_trips_a_tool_call(proxy_of: Callable[..., Any]) -> None:
    svc, engine = proxy_of([TOOL_CALL, "7", "3"], agent="relax_hpc.agents.examples.langchain_agent:BoxAgent")
    groups, _ = svc.generate_groups([Row(0, [], "what is in box a?", "7", {})], 1, seed=3, first_group_id=1)
    [[call, answer]] = groups  # individual samples: the call, then the answer
    assert call.response_text == TOOL_CALL and answer.response_text == "7"
    assert answer.metadata["env_reward"] == pytest.approx(1.0)
    assert all(s.loss_mask == [1] * len(s.response_ids) for s in (call, answer))
    g2 = engine.produced[1]
    assert "<tool_response>\n7\n</tool_response>" in engine.tokenizer.decode(g2.prompt_ids)
    # No call at all: no reward, whatever the answer (the prompt does not say the digit).
    svc2, _ = proxy_of(["7"], agent="relax_hpc.agents.examples.langchain_agent:BoxAgent")
    groups, _ = svc2.generate_groups([Row(0, [], "what is in box a?", "7", {})], 1, seed=3, first_group_id=1)
    assert groups[0][0].metadata["env_reward"] == 0.0


def test_langchain_and_agents_sdk_hit_401_and_400_like_any_client(proxy_of: Callable[..., Any]) -> None:
    from agents import Agent, RunConfig, Runner, function_tool
    from agents.models.openai_provider import OpenAIProvider
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    svc, engine = proxy_of(["x"])
    _, proxy, session = _client(svc)

    @tool
    def lookup() -> str:
        """Look it up."""
        return "7"

    for key in ("sk-wrong", f"{proxy_token()}.sk-relax-guessed"):
        llm = ChatOpenAI(model="policy", base_url=proxy.base_url, api_key=key, max_retries=0).bind_tools([lookup])
        with pytest.raises(openai.AuthenticationError):
            llm.invoke("hi")

    @function_tool(name_override="bad name")
    def bad() -> str:
        """Badly named."""
        return ""

    agent = Agent(name="a", model="policy", tools=[bad])
    sdk = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=session.api_key, max_retries=0)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=sdk), tracing_disabled=True)

    async def run() -> None:
        async with sdk:  # closed after: no connection is left open to the proxy
            await Runner.run(agent, "hi", run_config=config)

    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.name = 'bad name'"):
        asyncio.run(run())
    assert engine.produced == []
    assert sdk_agent.BoxAgent and langchain_agent.BoxAgent  # both import with their framework only


def test_a_tool_call_cut_at_max_tokens_keeps_finish_length(proxy_of: Callable[..., Any], tok: Any) -> None:
    # The call is whole, the text after it was cut: the agent must know the turn never ended
    # (the Responses API says "incomplete"), or it would send back a turn the model did not write.
    svc, _ = proxy_of([TOOL_CALL + "xy"])
    client, _, _ = _client(svc)
    limit = len(tok.encode(TOOL_CALL, add_special_tokens=False)) + 1
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "box?"}],
                                           tools=tools, max_tokens=limit)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content == "x"
    assert [c.function.name for c in reply.choices[0].message.tool_calls or []] == ["lookup"]
    cut = client.responses.create(model="policy", input="box?", max_output_tokens=limit,
                                  tools=[{"type": "function", "name": "lookup", "parameters": {"type": "object"}}])
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in cut.output] == ["message", "function_call"]


def test_example_specs_name_importable_agents() -> None:
    from pathlib import Path

    from relax_hpc.agents.config import agent_code_problems
    from relax_hpc.spec import load_spec

    root = Path(__file__).resolve().parents[2]
    for name, module in (("agent_tools_sdk", sdk_agent), ("agent_tools_langchain", langchain_agent)):
        rollout = load_spec(root / "jobspecs" / f"{name}.toml").rollout
        assert rollout.agent == f"{module.__name__}:BoxAgent" and rollout.agent_export_style == "concat"
        assert agent_code_problems(rollout) == []
