"""Reading a request body under a size limit, for the ASGI servers (the elastic REST API, the
agent proxy). Here, in the engines layer, so both can use it (the proxy sits above)."""

from __future__ import annotations

from starlette.requests import Request

__all__ = ["RequestRefused", "read_limited_body"]


class RequestRefused(Exception):
    """A request refused before it is acted on: the HTTP status and the message to send."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def read_limited_body(request: Request, max_bytes: int, who: str = "this server") -> bytes:
    """The request's body, refused (413) from its Content-Length before reading, or as soon as
    a body sent without one (chunked) passes `max_bytes`; 400 for a Content-Length that is not
    a byte count."""
    declared = request.headers.get("content-length")
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
