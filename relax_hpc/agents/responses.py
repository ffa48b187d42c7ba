"""The Responses API (`POST /v1/responses`) on the chat path of the agent proxy (pure functions).

A Responses request is turned into the chat completions body the proxy already serves, so both
APIs share one engine path, one chat template rendering and one recording:

- `instructions` becomes the first (system) message; `input` (a string, or a list of items) the
  rest: messages (`input_text`, `output_text` and `input_image` parts), `function_call` items
  (an assistant message's tool calls; a call right after an assistant message joins it, as the
  model wrote them in one turn) and `function_call_output` items (tool messages).
- `previous_response_id` (a response of the same session) puts that response's conversation,
  its input and output, before the new input; its instructions are not carried over, as OpenAI
  does.
- function tools `{"type": "function", "name", "description", "parameters", "strict"}` become
  chat tools; `tool_choice`, `parallel_tool_calls` and `max_output_tokens` map one to one.

The reply is a `response` object: a `message` item with one `output_text` part (when the model
wrote text), then one `function_call` item per parsed tool call; status "incomplete" (reason
`max_output_tokens`) when the generation was cut at the token limit.

    turn = responses_turn(body, previous)     # previous: response id -> conversation, this session's
    req = parse_chat_request(turn.chat_body)  # then generated and recorded as any completion
    response = response_object(response_id, record, turn, model_name)
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Mapping

from relax_hpc.agents.export import CompletionRecord
from relax_hpc.agents.tools import RequestError, parse_tools

# Keys a client may send that change nothing here: the proxy keeps no server-side store beyond the
# session, writes no reasoning items and samples with the rollout's own settings.
IGNORED_KEYS = ("model", "include", "store", "metadata", "temperature", "top_p", "truncation", "reasoning",
                "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier",
                "top_logprobs", "context_management", "prompt_cache_options")
_SERVED_KEYS = ("input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
                "previous_response_id", "stream", "text", "background", "conversation")
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")


@dataclass(frozen=True)
class ResponsesTurn:
    """One Responses request as the chat path serves it, and what its response echoes back."""

    chat_body: dict[str, Any]  # a /v1/chat/completions body
    conversation: list[dict[str, Any]]  # the chat messages without the instructions' system message
    instructions: str | None
    tools: list[dict[str, Any]]  # as sent (Responses form)
    tool_choice: Any
    parallel_tool_calls: bool
    max_output_tokens: int | None
    previous_response_id: str | None


def _part(part: Any, where: str, role: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "input_image" and role == "user":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise RequestError(400, f"{where}.image_url must be a data: URL (file_id images are not served)")
        return {"type": "image_url", "image_url": {"url": url}}
    raise RequestError(400, f"{where}: part type {str(kind)[:40]!r} is not accepted in {role} messages; the proxy "
                            "takes input_text / output_text parts, and input_image parts with a data: URL in user "
                            "messages")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise RequestError(400, f"{where}.role = {str(role)[:40]!r}: must be one of {', '.join(_MESSAGE_ROLES)}")
    content = item.get("content")
    if isinstance(content, list):
        content = [_part(p, f"{where}.content[{k}]", str(role)) for k, p in enumerate(content)]
        if all(p["type"] == "text" for p in content):
            content = "".join(p["text"] for p in content)
    elif not isinstance(content, str):
        raise RequestError(400, f"{where}.content must be a string or a list of content parts")
    return {"role": "system" if role == "developer" else role, "content": content}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise RequestError(400, f"{where}.{key} must be a string (a function_call item has call_id, name and "
                                    "arguments, the JSON text the model wrote)")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise RequestError(400, f"{where}.call_id must be the call_id of the function_call this output answers")
    output = item.get("output")
    if isinstance(output, list):
        output = "".join(_part(p, f"{where}.output[{k}]", "tool")["text"] for k, p in enumerate(output))
    elif not isinstance(output, str):
        raise RequestError(400, f"{where}.output must be a string or a list of input_text parts")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: function calls join the assistant message right before them."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise RequestError(400, "input must be a string or a non-empty list of items")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, where))  # type: ignore[arg-type]
        elif kind == "function_call":
            call = _function_call(item, where)  # type: ignore[arg-type]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and isinstance(last["content"], str):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_call_output(item, where))  # type: ignore[arg-type]
        else:
            raise RequestError(400, f"{where}.type = {str(kind)[:40]!r}: the proxy serves message, function_call "
                                    "and function_call_output items")
    return messages


def _tools(raw: Any) -> list[dict[str, Any]]:
    """Responses function tools in the chat form; 400 names the field as the client sent it."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError(400, "tools must be a list of function tools")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(400, f'tools[{i}].type = {str(kind)[:40]!r}: must be "function" (built-in tools such '
                                    "as web search are not served)")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool and tool[k] is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise RequestError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", '
                                    '"name": ...}')
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _chat_path(message: str) -> str:
    """A chat-form tool error named as the Responses field: tools[1].function.name -> tools[1].name."""
    return message.replace(".function.", ".").replace("tool_choice.function.name", "tool_choice.name")


def responses_turn(body: Any, previous: Mapping[str, list[dict[str, Any]]]) -> ResponsesTurn:
    """Validate a /v1/responses body; `previous`: this session's conversations by response id."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if body.get("stream"):
        raise RequestError(400, "stream = true is not served on /v1/responses (the engine returns whole "
                                "generations); call without stream (the OpenAI Agents SDK's Runner.run does), or "
                                "stream from /v1/chat/completions")
    for key in ("background", "conversation"):
        if body.get(key):
            raise RequestError(400, f"{key} is not served: the proxy keeps a conversation only as "
                                    "previous_response_id within one session")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError(400, 'text.format: only {"type": "text"} is served (structured outputs need constrained '
                                "decoding, which the proxy does not do)")
    unknown = sorted(set(body) - set(_SERVED_KEYS) - set(IGNORED_KEYS))
    if unknown:
        raise RequestError(400, f"unknown or unsupported keys: {', '.join(k[:40] for k in unknown[:8])}")
    before: list[dict[str, Any]] = []
    prev_id = body.get("previous_response_id")
    if prev_id is not None:
        if not isinstance(prev_id, str) or prev_id not in previous:
            raise RequestError(404, f"previous_response_id = {str(prev_id)[:80]!r}: no such response in this session")
        before = [dict(m) for m in previous[prev_id]]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError(400, "instructions must be a string")
    conversation = before + input_messages(body.get("input"))
    system = [{"role": "system", "content": instructions}] if instructions else []
    max_out = body.get("max_output_tokens")
    parallel = body.get("parallel_tool_calls", True)
    chat_body: dict[str, Any] = {"messages": system + conversation, "max_tokens": max_out,
                                 "tools": _tools(body.get("tools")) or None,
                                 "tool_choice": _tool_choice(body.get("tool_choice")),
                                 "parallel_tool_calls": True if parallel is None else parallel}
    try:
        parse_tools(chat_body)  # validated here, so that its 400 names the field as sent
    except RequestError as e:
        raise RequestError(e.status, _chat_path(e.message)) from None
    return ResponsesTurn(chat_body, conversation, instructions, list(body.get("tools") or []),
                         body.get("tool_choice") or "auto", bool(chat_body["parallel_tool_calls"]),
                         max_out, prev_id)


def assistant_message(record: CompletionRecord) -> dict[str, Any]:
    """The reply as a chat message of the conversation (what previous_response_id brings back)."""
    message = (record.served or {}).get("message") or {"content": record.text}
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [dict(c) for c in message["tool_calls"]]
    return out


def _output_items(record: CompletionRecord) -> list[dict[str, Any]]:
    message = assistant_message(record)
    status = "incomplete" if record.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if message["content"] or not message.get("tool_calls"):
        items.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "role": "assistant",
                      "status": status, "content": [{"type": "output_text", "text": message["content"],
                                                     "annotations": [], "logprobs": []}]})
    for call in message.get("tool_calls", []):
        items.append({"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def response_object(response_id: str, record: CompletionRecord, turn: ResponsesTurn, model: str) -> dict[str, Any]:
    """The `response` the Responses API returns for one recorded completion."""
    cut = record.finish_reason == "length"
    prompt, completion = len(record.prompt_ids), len(record.response_ids)
    now = int(time.time())
    return {
        "id": response_id, "object": "response", "created_at": now, "completed_at": now, "model": model,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "output": _output_items(record), "instructions": turn.instructions, "tools": turn.tools,
        "tool_choice": turn.tool_choice, "parallel_tool_calls": turn.parallel_tool_calls,
        "previous_response_id": turn.previous_response_id, "max_output_tokens": turn.max_output_tokens,
        "temperature": None, "top_p": None, "metadata": {}, "text": {"format": {"type": "text"}},
        "truncation": "disabled", "store": True,
        "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": prompt + completion},
    }
