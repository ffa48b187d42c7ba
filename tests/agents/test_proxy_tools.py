"""Agents as people write them, against the real proxy and the official `openai` SDK: native tool
calls (schemas, parsing, the round trip, what is recorded and trained), streaming, n > 1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from relax_hpc.agents.proxy import AgentProxy, parse_chat_request, proxy_token
from relax_hpc.agents.service import AgenticRollout
from relax_hpc.agents.sessions import Session
from relax_hpc.agents.tools import RequestError, parse_reply, parse_tools
from relax_hpc.auth import JobSecret
from relax_hpc.data.dataset import PromptRow as Row
from relax_hpc.engines.base import SamplingParams
from relax_hpc.spec.schema import RolloutSpec
from agent_doubles import ScriptedEngine, tiny_tokenizer
from tool_agents import WEATHER_CALL, WEATHER_TOOL, load_tool_tokenizer

ASK = [{"role": "user", "content": "weather in paris?"}]
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tool_tokenizer(tmp_path_factory.mktemp("tool-tokenizer"))


def _service(tok: Any, script: list[str], **cfg: Any) -> tuple[AgenticRollout, ScriptedEngine]:
    engine = ScriptedEngine(tok, script, version=3)
    params = SamplingParams(max_new_tokens=200, stop_token_ids=(int(tok.eos_token_id),))
    config = RolloutSpec(agent="tool_agents:ToolAgent", **cfg)
    return AgenticRollout(config, engine, tok, params, int(tok.eos_token_id)), engine  # type: ignore[arg-type]


@dataclass
class Served:
    """A running proxy, its scripted engine, one open session and a sync SDK client with its key."""

    svc: AgenticRollout
    engine: ScriptedEngine
    session: Session
    client: openai.OpenAI

    @property
    def proxy(self) -> AgentProxy:
        assert self.svc.proxy is not None
        return self.svc.proxy

    def get(self, completion_id: str) -> dict[str, Any]:
        reply = httpx.get(f"{self.proxy.base_url}/chat/completions/{completion_id}", timeout=30,
                          headers={"Authorization": f"Bearer {self.session.api_key}"})
        assert reply.status_code == 200, reply.text
        return reply.json()


@pytest.fixture
def serve(tok: Any) -> Iterator[Callable[[list[str]], Served]]:
    """serve(script): a proxy whose engine answers with `script`, closed after the test."""
    started: list[AgenticRollout] = []

    def start(script: list[str]) -> Served:
        svc, engine = _service(tok, script)
        started.append(svc)
        assert svc.proxy is not None
        session = svc.proxy.sessions.open()
        return Served(svc, engine, session,
                      openai.OpenAI(base_url=svc.proxy.base_url, api_key=session.api_key, max_retries=0))

    yield start
    for svc in started:
        svc.close()


def test_tool_schemas_are_validated_field_by_field() -> None:
    body = {"messages": ASK}
    for tools, extra, field in [
        ([WEATHER_TOOL, {"type": "function", "function": {"name": "bad name!"}}], {}, "tools[1].function.name"),
        ([{"type": "retrieval"}], {}, "tools[0].type"),
        ([{"type": "function"}], {}, "tools[0].function must be"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], {}, "tools[0].function.parameters"),
        ([WEATHER_TOOL, WEATHER_TOOL], {}, "tools[1].function.name = 'get_weather' is given twice"),
        ([WEATHER_TOOL], {"tool_choice": "always"}, "tool_choice = 'always'"),
        ([WEATHER_TOOL], {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "tool_choice.function.name = 'get_time' is not one of the request's tools (get_weather)"),
        ([WEATHER_TOOL], {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (None, {"tool_choice": "required"}, "needs tools"),
        (None, {"functions": [{"name": "f"}]}, "deprecated form"),
    ]:
        with pytest.raises(RequestError) as err:
            parse_chat_request({**body, **({"tools": tools} if tools else {}), **extra})
        assert err.value.status == 400 and field in err.value.message, (field, err.value.message)
    assert parse_tools({"tools": [WEATHER_TOOL], "tool_choice": "none"}) is None
    named = parse_tools({"tools": [WEATHER_TOOL, TIME_TOOL],
                        "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named is not None and named.names == {"get_weather", "get_time"} and named.parallel


def test_replies_are_parsed_into_tool_calls_or_kept_as_text() -> None:
    names = frozenset({"get_weather", "get_time"})
    plain = parse_reply("it is sunny", names)
    assert (plain.content, plain.tool_calls, plain.malformed) == ("it is sunny", (), False)
    two = parse_reply('let me look.\n' + WEATHER_CALL + '\n<tool_call>\n{"name": "get_time"}\n</tool_call>', names)
    assert two.content == "let me look." and not two.malformed
    assert [(c.name, json.loads(c.arguments)) for c in two.tool_calls] == [("get_weather", {"city": "paris"}),
                                                                           ("get_time", {})]
    assert all(c.call_id.startswith("call_") and len(c.call_id) == 29 for c in two.tool_calls)
    assert two.tool_calls[0].call_id != two.tool_calls[1].call_id
    for bad in ["<tool_call>{not json}</tool_call>", '<tool_call>{"name": "rm_rf"}</tool_call>',
                '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
                WEATHER_CALL + "<tool_call>{", "done</tool_call>"]:
        reply = parse_reply(bad, names)
        assert (reply.content, reply.tool_calls, reply.malformed) == (bad, (), True), bad


def test_tool_call_round_trip_with_the_sync_sdk(serve: Callable[[list[str]], Served], tok: Any) -> None:
    served = serve([WEATHER_CALL, "sunny"])
    engine, client = served.engine, served.client
    first = client.chat.completions.create(model="policy", messages=ASK, tools=[WEATHER_TOOL],
                                           tool_choice="auto", parallel_tool_calls=True)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "paris"})
    msgs = [*ASK, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
    final = client.chat.completions.create(model="policy", messages=msgs, tools=[WEATHER_TOOL])
    assert final.choices[0].message.content == "sunny" and final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.tool_calls is None
    # The prompts are the template's: tools in the system turn, the call and its result re-rendered.
    g1, g2 = engine.produced
    assert g1.prompt_ids == tok.encode(tok.apply_chat_template(ASK, tools=[WEATHER_TOOL], tokenize=False,
                                                               add_generation_prompt=True), add_special_tokens=False)
    assert g2.prompt_ids[:len(g1.prompt_ids) + len(g1.token_ids)] == g1.prompt_ids + g1.token_ids
    between = tok.decode(g2.prompt_ids[len(g1.prompt_ids) + len(g1.token_ids):])
    assert between == "\n<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # Recorded: the generated tokens, the tool-call text included; the stored id serves the same calls.
    records = served.session.completions
    assert [(r.response_ids, r.text) for r in records] == [(g.token_ids, g.text) for g in (g1, g2)]
    assert records[0].text == WEATHER_CALL and records[0].finish_reason == "stop"
    again = client.chat.completions.retrieve(first.id)
    assert again.choices[0].message.tool_calls is not None
    assert [c.id for c in again.choices[0].message.tool_calls] == [call.id]


def test_concat_sample_trains_exactly_the_generated_tokens(tok: Any) -> None:
    svc, engine = _service(tok, [WEATHER_CALL, "sunny"], agent_export_style="concat")
    try:
        groups, stats = svc.generate_groups([Row(0, [], "weather in paris?", "x", {})], 1, seed=5,
                                            first_group_id=1)
    finally:
        svc.close()
    [[sample]] = groups
    g1, g2 = engine.produced
    between = g2.prompt_ids[len(g1.prompt_ids) + len(g1.token_ids):]
    assert sample.prompt_ids == g1.prompt_ids
    assert sample.response_ids == g1.token_ids + between + g2.token_ids
    # Mask 1 on exactly the model's tokens (the tool call with its end-of-turn, then the answer),
    # 0 on the template's tool result and headers between them.
    assert sample.loss_mask == [1] * len(g1.token_ids) + [0] * len(between) + [1] * len(g2.token_ids)
    assert [t for t, m in zip(sample.response_ids, sample.loss_mask) if m] == g1.token_ids + g2.token_ids
    assert "<tool_response>\n18C\n</tool_response>" in tok.decode(between)
    assert sample.rollout_log_probs == g1.logprobs + [0.0] * len(between) + g2.logprobs
    assert sample.metadata["env_reward"] == 1.0 and stats["agent/malformed_tool_calls"] == 0.0


def test_malformed_tool_calls_come_back_as_text_and_are_counted(tok: Any) -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    svc, engine = _service(tok, [bad])
    try:
        groups, stats = svc.generate_groups([Row(0, [], "weather?", "x", {})], 2, seed=5, first_group_id=1)
        assert svc.proxy is not None and svc.proxy.malformed_tool_calls == 2
    finally:
        svc.close()
    assert stats["agent/malformed_tool_calls"] == 2.0  # two sessions, one malformed reply each
    assert [s.metadata["env_reward"] for s in groups[0]] == [0.0, 0.0]  # the agent saw no tool calls
    assert [s.response_text for s in groups[0]] == [bad, bad] and len(engine.produced) == 2


def test_tool_choice_none_renders_and_parses_no_tools(serve: Callable[[list[str]], Served], tok: Any) -> None:
    served = serve([WEATHER_CALL, '<tool_call>{"name": "nope"}</tool_call>'])
    engine, client = served.engine, served.client
    reply = client.chat.completions.create(model="policy", messages=ASK, tools=[WEATHER_TOOL], tool_choice="none")
    assert reply.choices[0].message.content == WEATHER_CALL and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"
    assert "<tools>" not in tok.decode(engine.produced[0].prompt_ids)
    # "required" cannot force a call: the model's text comes back as it is (here an unknown tool).
    forced = client.chat.completions.create(model="policy", messages=ASK, tools=[WEATHER_TOOL],
                                            tool_choice="required")
    assert forced.choices[0].message.content == '<tool_call>{"name": "nope"}</tool_call>'
    assert forced.choices[0].finish_reason == "stop" and served.proxy.malformed_tool_calls == 1


def test_bad_schema_is_400_naming_the_field_and_keys_are_still_checked(serve: Callable[[list[str]], Served]) -> None:
    served = serve(["x"])
    engine, client, url = served.engine, served.client, served.proxy.base_url
    bad = [WEATHER_TOOL, {"type": "function", "function": {"name": "has space", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="policy", messages=ASK, tools=bad)
    assert err.value.status_code == 400 and "tools[1].function.name" in err.value.message
    forged = JobSecret.generate().token("agent-proxy") + client.api_key[len(proxy_token()):]
    for key in ("sk-wrong", forged, f"{proxy_token()}.sk-relax-guessed"):
        other = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        for extra in ({"tools": [WEATHER_TOOL]}, {"stream": True}, {"n": 2}):
            with pytest.raises(openai.AuthenticationError):
                other.chat.completions.create(model="policy", messages=ASK, **extra)
    r = httpx.post(f"{url}/chat/completions", json={"messages": ASK, "stream": True}, timeout=30)
    assert r.status_code == 401
    assert engine.produced == []


def test_a_template_without_a_tool_format_refuses_tools() -> None:
    svc, engine = _service(tiny_tokenizer(), ["ab"])
    try:
        assert svc.proxy is not None
        client = openai.OpenAI(base_url=svc.proxy.base_url, api_key=svc.proxy.sessions.open().api_key, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not render tools"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                           tools=[WEATHER_TOOL])
        assert engine.produced == []
    finally:
        svc.close()


def test_stream_chunks_reassemble_to_the_recorded_completion(serve: Callable[[list[str]], Served]) -> None:
    served = serve(["it is sunny in paris today, 18 degrees and a light wind"])
    client = served.client
    chunks = list(client.chat.completions.create(model="policy", messages=ASK, stream=True,
                                                 stream_options={"include_usage": True}))
    [record] = served.session.completions
    assert {c.id for c in chunks} == {record.completion_id}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == record.text == "it is sunny in paris today, 18 degrees and a light wind"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    *_, usage = chunks
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (len(record.prompt_ids),
                                                                          len(record.response_ids))
    # On the wire: server-sent events, ending with [DONE].
    with httpx.stream("POST", f"{served.proxy.base_url}/chat/completions", timeout=30,
                      json={"model": "policy", "messages": ASK, "stream": True},
                      headers={"Authorization": f"Bearer {client.api_key}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert len(served.session.completions) == 2


def test_async_stream_with_tool_calls_matches_the_stored_completion(serve: Callable[[list[str]], Served]) -> None:
    served = serve([WEATHER_CALL])
    sync_client = served.client

    async def stream() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=sync_client.base_url, api_key=sync_client.api_key, max_retries=0)
        async with client:
            reply = await client.chat.completions.create(model="policy", messages=ASK, tools=[WEATHER_TOOL],
                                                         stream=True)
            return [chunk async for chunk in reply]

    chunks = asyncio.run(stream())
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    stored = served.get(chunks[0].id)
    [want] = stored["choices"][0]["message"]["tool_calls"]
    assert [(tc.index, tc.id, tc.function.name, tc.function.arguments) for tc in calls] == [
        (0, want["id"], "get_weather", want["function"]["arguments"])]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""  # no text outside the call


def test_n_choices_are_each_generated_and_recorded(serve: Callable[[list[str]], Served]) -> None:
    served = serve(["one", "two", "three"])
    engine, client = served.engine, served.client
    reply = client.chat.completions.create(model="policy", messages=ASK, n=3)
    assert [(c.index, c.message.content) for c in reply.choices] == [(0, "one"), (1, "two"), (2, "three")]
    records = served.session.completions
    assert [r.completion_id for r in records] == [f"{reply.id}-{k}" for k in range(3)]
    assert [r.response_ids for r in records] == [g.token_ids for g in engine.produced]
    assert all(r.prompt_ids == records[0].prompt_ids for r in records)
    assert reply.usage is not None and reply.usage.completion_tokens == sum(len(r.response_ids) for r in records)
    assert reply.usage.prompt_tokens == len(records[0].prompt_ids)
    # Each choice is a prompt of the batch (the engine seeds each prompt of a call on its own).
    assert [len(prompts) for prompts, _, _ in engine.calls] == [3]
    whole, one = served.get(reply.id), served.get(f"{reply.id}-1")
    assert [c["message"]["content"] for c in whole["choices"]] == ["one", "two", "three"]
    assert [c["message"]["content"] for c in one["choices"]] == ["two"]
    # Streamed, each choice's chunks carry its index.
    chunks = list(client.chat.completions.create(model="policy", messages=ASK, n=2, stream=True))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert texts == {0: "one", 1: "two"} and len(served.session.completions) == 5
    with pytest.raises(openai.BadRequestError, match="n = 17"):
        client.chat.completions.create(model="policy", messages=ASK, n=17)
