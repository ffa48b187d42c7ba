"""Reading a request body under a size limit and decoding it as JSON, for the ASGI servers (the
engine server, the elastic REST API, the agent proxy). Here, in the engines layer, so all can use
it (the proxy sits above)."""

from __future__ import annotations

import json
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request

from relax_hpc.engines.http.serving import INVALID_LENGTH_HEADER

__all__ = ["JsonBodyError", "RequestRefused", "declared_length", "load_json_body", "read_limited_body"]


class JsonBodyError(ValueError):
    """A body that is not JSON, or is nested deeper than allowed; the message says which."""


def _deeper_than(value: Any, max_depth: int) -> bool:
    """Whether containers nest more than `max_depth` levels (`[]` is 1, `{"a": [1]}` is 2)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def load_json_body(raw: bytes, max_depth: int) -> Any:
    """A UTF-8 JSON request body decoded; JsonBodyError when it is not JSON or nests too deep.

    The decoder recurses once per level, so a deep enough body would end in RecursionError (a
    500); that and anything between `max_depth` and the recursion limit are refused alike. An
    integer of more than 4300 digits (Python's int-from-text limit) is refused too: json.loads
    raises a plain ValueError for it, which would otherwise escape as a 500."""
    too_deep = f"the JSON body nests more than {max_depth} levels deep; at most {max_depth} are accepted"
    try:
        value = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise JsonBodyError(too_deep) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise JsonBodyError(f"the body is not valid JSON: {e}") from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise JsonBodyError(f"the JSON body holds a number too long to read ({e}); send integers of at most "
                            "4300 digits (no value this server takes needs more than 19)") from None
    if isinstance(value, (dict, list)) and _deeper_than(value, max_depth):
        raise JsonBodyError(too_deep)
    return value


def declared_length(headers: Headers) -> str | None:
    """The request's Content-Length as sent, also one the serving protocol renamed because it is
    not a byte count (http/serving.py); None without one."""
    value = headers.get("content-length")
    return value if value is not None else headers.get(INVALID_LENGTH_HEADER)


class RequestRefused(Exception):
    """A request refused before it is acted on: the HTTP status and the message to send."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def read_limited_body(request: Request, max_bytes: int, who: str = "this server") -> bytes:
    """The request's body, refused (413) from its Content-Length before reading, or as soon as
    a body sent without one (chunked) passes `max_bytes`; 400 for a Content-Length that is not
    a byte count."""
    declared = declared_length(request.headers)
    if declared is not None:
        text = declared.strip()
        if not (text.isascii() and text.isdigit()):
            raise RequestRefused(400, f"Content-Length {declared[:40]!r} is not a byte count")
        if len(text) > 18 or int(text) > max_bytes:
            raise RequestRefused(413, f"the request body is {text[:40]} bytes; at most {max_bytes} are accepted")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestRefused(413, f"the request body is over {max_bytes} bytes, the most {who} accepts")
        chunks.append(chunk)
    return b"".join(chunks)
