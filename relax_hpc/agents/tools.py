"""Native tool calls for the agent proxy: the request's tool schemas, the conversation's earlier
calls and results, and the calls parsed out of the model's text (pure functions).

A request's `tools` (OpenAI function schemas) go to the model's chat template as its `tools=`
argument, which writes them into the prompt in the model's own format. The reply is parsed for
Qwen3 / Hermes-style blocks, the format those templates teach the model:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "paris"}}
    </tool_call>

Every block must be a JSON object naming a tool of the request, with an object of arguments;
one that is not (bad JSON, an unknown name, a block never closed) makes the whole reply plain
content, counted as malformed. Decoding is not constrained: `tool_choice = "required"` or a
named function cannot make the model call a tool, only `"none"` changes anything (no tools in the
prompt, nothing parsed).

    tools = parse_tools(body)                      # None: no tools, or tool_choice = "none"
    reply = parse_reply(text, tools.names)         # .content, .tool_calls, .malformed
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from relax_hpc.engines.http.body import RequestRefused as RequestError

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
TOOL_CHOICES = ("auto", "none", "required")
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools as the chat template gets them, and how it asked for them to be used."""

    tools: tuple[dict[str, Any], ...]
    choice: str | dict[str, Any]  # "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)


@dataclass(frozen=True)
class ToolCall:
    call_id: str
    name: str
    arguments: str  # a JSON object, as text (what the OpenAI API sends)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedReply:
    content: str | None  # the text outside the tool-call blocks; None when there is none
    tool_calls: tuple[ToolCall, ...]
    malformed: bool  # the text had a tool-call block that could not be read


def _function(tool: Any, where: str) -> dict[str, Any]:
    """One tool schema, validated."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise RequestError(400, f'{where}.type must be "function" (the only kind of tool the proxy renders)')
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise RequestError(400, f"{where}.function must be an object with name, description and parameters")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise RequestError(400, f"{where}.function.name = {str(name)[:80]!r}: must match {TOOL_NAME.pattern}")
    if "description" in fn and not isinstance(fn["description"], str):
        raise RequestError(400, f"{where}.function.description must be a string")
    if "parameters" in fn and not isinstance(fn["parameters"], dict):
        raise RequestError(400, f"{where}.function.parameters must be a JSON schema object")
    return tool  # as sent, key order included: the template writes it with tojson


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools, validated; None when none are to be rendered (no `tools`, or
    `tool_choice = "none"`). RequestError(400) names the bad field."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise RequestError(400, "functions / function_call (the deprecated form) are not accepted; send tools "
                                'as [{"type": "function", "function": {...}}] and tool_choice')
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is not None and not isinstance(raw, list):
        raise RequestError(400, "tools must be a list of function tools")
    tools = tuple(_function(t, f"tools[{i}]") for i, t in enumerate(raw or []))
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t["function"]["name"] in seen:
            raise RequestError(400, f"tools[{i}].function.name = {t['function']['name']!r} is given twice")
        seen.add(t["function"]["name"])
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError(400, 'tool_choice must be "auto", "none", "required" or '
                                    '{"type": "function", "function": {"name": ...}}')
        if name not in seen:
            raise RequestError(400, f"tool_choice.function.name = {name[:80]!r} is not one of the request's tools "
                                    f"({', '.join(sorted(seen)) or 'none given'})")
    elif choice is not None and choice not in TOOL_CHOICES:
        raise RequestError(400, f"tool_choice = {str(choice)[:40]!r}: must be one of {', '.join(TOOL_CHOICES)} or "
                                '{"type": "function", "function": {"name": ...}}')
    elif choice == "required" and not tools:
        raise RequestError(400, 'tool_choice = "required" needs tools')
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError(400, f"parallel_tool_calls = {str(parallel)[:40]!r}: must be true or false")
    if not tools or choice == "none":
        return None
    return ToolRequest(tools, choice if choice is not None else "auto", parallel)


def template_tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` (OpenAI form, arguments a JSON string) as chat
    templates read them: arguments a dict, which templates write with `tojson`."""
    if not isinstance(raw, list):
        raise RequestError(400, f"{where}.tool_calls must be a list of tool calls")
    calls = []
    for k, call in enumerate(raw):
        at = f"{where}.tool_calls[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(400, f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise RequestError(400, f"{at}.function.arguments is not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise RequestError(400, f"{at}.function.arguments must be a JSON object")
        calls.append({"id": str(call.get("id", "")), "type": "function",
                      "function": {"name": fn["name"], "arguments": args}})
    return calls


def _read_block(block: str, names: frozenset[str]) -> tuple[str, dict[str, Any]] | None:
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    args = call.get("arguments", {})
    return (call["name"], args) if isinstance(args, dict) else None


def parse_reply(text: str, names: frozenset[str]) -> ParsedReply:
    """The tool calls in `text` (see the module docstring). A reply without any `<tool_call>` is
    plain content; one whose blocks cannot all be read is plain content and `malformed`."""
    if _OPEN not in text and _CLOSE not in text:
        return ParsedReply(text, (), False)
    calls: list[ToolCall] = []
    for match in _BLOCK.finditer(text):
        read = _read_block(match.group(1).strip(), names)
        if read is None:
            return ParsedReply(text, (), True)
        calls.append(ToolCall(f"call_{secrets.token_hex(12)}", read[0], json.dumps(read[1], ensure_ascii=False)))
    outside = _BLOCK.sub("", text)
    if not calls or _OPEN in outside or _CLOSE in outside:  # a block never closed, or never opened
        return ParsedReply(text, (), True)
    return ParsedReply(outside.strip() or None, tuple(calls), False)
