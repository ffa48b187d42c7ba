"""A whole chat completion as OpenAI `chat.completion.chunk` server-sent events (pure functions).

The engine returns whole generations, so the proxy generates (and records) a completion first
and then streams it: per choice a first chunk with the role, the content in pieces, the parsed
tool calls in one delta (parsing needs the whole text), a last chunk with the finish reason;
then a usage chunk when the request asked for it (`stream_options.include_usage`), then
`data: [DONE]`. Concatenating the deltas gives exactly the non-streamed message.

    for event in completion_events(response, include_usage=True):   # response: a chat.completion
        yield event                                                  # b"data: {...}\\n\\n"
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

CONTENT_PIECE_CHARS = 16  # content characters per delta


def _event(payload: dict[str, Any] | str) -> bytes:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def choice_deltas(choice: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str | None]]:
    """The (delta, finish_reason) pairs of one choice of a chat.completion, in order."""
    message = choice["message"]
    yield {"role": "assistant", "content": ""}, None
    content = message.get("content") or ""
    for start in range(0, len(content), CONTENT_PIECE_CHARS):
        yield {"content": content[start:start + CONTENT_PIECE_CHARS]}, None
    calls = message.get("tool_calls")
    if calls:
        yield {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}, None
    yield {}, choice["finish_reason"]


def completion_events(response: dict[str, Any], include_usage: bool = False) -> Iterator[bytes]:
    """Server-sent events of a chat.completion `response` (see the module docstring)."""
    head = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}
    if include_usage:
        head["usage"] = None  # as OpenAI does: every chunk but the last has usage null
    for choice in response["choices"]:
        for delta, finish in choice_deltas(choice):
            yield _event({**head, "choices": [{"index": choice["index"], "delta": delta, "logprobs": None,
                                               "finish_reason": finish}]})
    if include_usage:
        yield _event({**head, "choices": [], "usage": response["usage"]})
    yield _event("[DONE]")
