"""An OpenAI-compatible HTTP proxy in front of a rollout engine that records every completion.

Serves `POST /v1/chat/completions`, `GET /v1/chat/completions/{id}` and `GET /v1/models`. Every
request, any route, must carry `Authorization: Bearer <token>` or `Bearer <token>.<session>`
(401 otherwise, before routing reads anything of the body); `token` is the owner's, in a job
`proxy_token()`. Each agent session gets its own API key `<token>.<session>` (see `sessions.py`),
which the completion routes also require, and which the agent gets as its OpenAI `api_key`
(`workflow.py`); `/v1/models` takes the bare token too. The proxy applies the model's chat
template to the request's messages, generates through the `EngineBatcher` (so concurrent
sessions share engine calls) and keeps the prompt and response token ids and log-probs of each
completion for training. User messages may carry images and audio as OpenAI content parts
(`image_url` with a data: URL, `input_audio`; see `relax_hpc/agents/media.py`) when the model is
multimodal: they are decoded and fitted once, their placeholders expanded, and they go to the
engine and into the record with the prompt. Sampling uses the rollout's configured
temperature/top-p/top-k (the trainer recomputes log-probs at that temperature); a request may
lower `max_tokens` and add `stop` strings. Requests that cannot be served get a 4xx with a
message saying why: a body over `max_body_bytes` gets 413 before it is read whole, one nested
deeper than `max_json_depth` 400.

    proxy = AgentProxy(batcher, tokenizer, sampling, token=proxy_token(), model_name="policy", ttl_s=600,
                       media_processor=MediaProcessor(model_dir))  # None (the default): a text model
    await proxy.start()                 # in the event loop that owns the batcher
    session = proxy.sessions.open()     # session.api_key, proxy.base_url
    ...
    records = proxy.sessions.close(session)
    await proxy.stop()
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from relax_hpc.agents.batcher import EngineBatcher
from relax_hpc.agents.export import CompletionRecord
from relax_hpc.agents.media import (
    REQUEST_MEDIA_TYPES,
    MediaPart,
    PartError,
    load_part,
    parse_media_part,
    prompt_media,
)
from relax_hpc.agents.sessions import SessionAuthError, SessionStore
from relax_hpc.auth import bearer_matches, job_secret
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.http_auth import check_token
from relax_hpc.engines.http_body import JsonBodyError, RequestRefused, load_json_body, read_limited_body
from relax_hpc.engines.http_serving import ServingLimits, uvicorn_config
from relax_hpc.media.families import supported_model_types
from relax_hpc.media.items import MediaError, PromptMedia
from relax_hpc.media.load import MediaLimits

# A chat request's body: 8 MiB is about 2M tokens of text, far beyond any model's context, or a
# few images inline (a multi-turn request re-sends every image of the conversation so far).
MAX_BODY_BYTES = 8 * 1024 * 1024
# Messages with text parts nest 5 levels; the limit leaves room for fields the proxy ignores.
MAX_JSON_DEPTH = 32
# Agents on this host: a request has 30 s to arrive (an 8 MiB body of images included), 256
# connections may be open (many sessions at once), 32 from one address before they show the token
# (every agent comes from 127.0.0.1, and a connection is without it only until its headers are in).
PROXY_LIMITS = ServingLimits(request_timeout_s=30.0, max_connections=256, max_untrusted_per_peer=32)
PROXY_TOKEN_PURPOSE = "agent-proxy"
PROXY_AUTH_MESSAGE = (
    "missing or wrong bearer token: agent code gets its key as the api_key argument (inline agents) or "
    "OPENAI_API_KEY (subproc agents) and sends it as 'Authorization: Bearer <key>'; the proxy's token is "
    f"JobSecret.token('{PROXY_TOKEN_PURPOSE}') of the job secret"
)


def proxy_token() -> str:
    """This job's proxy token (RELAX_HPC_SECRET_FILE names the secret)."""
    return job_secret().token(PROXY_TOKEN_PURPOSE)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


class RequireToken:
    """ASGI middleware: 401 for every request whose bearer value is not `token` or
    `token.<anything>`, answered before routing, so no body is read."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = Headers(scope=scope).get("authorization")
            # "Bearer <token>.<session>" -> "Bearer <token>"; a token has no ".".
            if not bearer_matches(header.partition(".")[0] if header else None, self.token):
                await _error(401, PROXY_AUTH_MESSAGE, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


RequestError = RequestRefused  # a request refused before it reaches the engine: its status and message


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]  # content: a string, or template parts with {"type": "image" | "audio"}
    max_tokens: int | None
    stop: tuple[str, ...]
    media: tuple[MediaPart, ...] = ()  # in conversation order, not yet decoded


_ROLES = ("system", "user", "assistant", "tool", "developer")
_PART_FORMS = ('text parts ({"type": "text", "text": "..."}), and in user messages image_url parts with a '
               'data: URL and input_audio parts')


def _content(content: Any, where: str, role: str) -> tuple[str | list[dict[str, Any]], list[MediaPart]]:
    """A message's content for the chat template and its media. All-text content becomes one
    string (as text-only templates expect); with media it stays a list of parts, each medium a
    {"type": kind} part for which the template writes one placeholder."""
    if isinstance(content, str):
        return content, []
    if content is None:
        return "", []
    if not isinstance(content, list):
        raise RequestError(400, f"{where}.content must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    media: list[MediaPart] = []
    for k, part in enumerate(content):
        at, kind = f"{where}.content[{k}]", part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif isinstance(kind, str) and kind in REQUEST_MEDIA_TYPES and role == "user":
            try:
                media.append(parse_media_part(part, at))
            except PartError as e:
                raise RequestError(400, str(e)) from None
            parts.append({"type": media[-1].kind})
        else:
            what = f"part type {str(kind)[:40]!r}" if isinstance(part, dict) else f"a {type(part).__name__}"
            raise RequestError(400, f"{at}: {what} is not accepted in {role} messages; the proxy takes {_PART_FORMS}")
    if not media:
        return "".join(p["text"] for p in parts), []
    return parts, media


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a /v1/chat/completions body; RequestError(4xx, what is wrong) when invalid."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if body.get("stream"):
        raise RequestError(400, "stream = true is not supported; request a whole completion")
    if body.get("n", 1) != 1:
        raise RequestError(400, f"n = {body.get('n')!r}: only n = 1 is supported (one completion per request)")
    if body.get("tools") or body.get("functions"):
        raise RequestError(400, "native tool calling is not supported; describe tools in the prompt "
                                "and parse the model's text")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects")
    parsed, media = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise RequestError(400, f"messages[{i}] must be an object with role one of {', '.join(_ROLES)}")
        content, parts = _content(m.get("content"), f"messages[{i}]", str(m["role"]))
        parsed.append({"role": str(m["role"]), "content": content})
        media += parts
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError(400, f"max_tokens = {max_tokens!r}: must be an integer >= 1")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise RequestError(400, "stop must be a string or a list of non-empty strings")
    return ChatRequest(parsed, max_tokens, stops, tuple(media))


class AgentProxy:
    """The HTTP proxy; start it inside the event loop that owns `batcher`. `media_processor`: the
    model's `relax_hpc.media.processor.MediaProcessor` (None: a text model, which refuses media)."""

    def __init__(self, batcher: EngineBatcher, tokenizer: Any, sampling: SamplingParams, *, token: str,
                 model_name: str = "policy", ttl_s: float = 600.0, host: str = "127.0.0.1",
                 max_context_tokens: int | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 max_json_depth: int = MAX_JSON_DEPTH, media_processor: Any = None,
                 media_limits: MediaLimits | None = None, limits: ServingLimits | None = None) -> None:
        self.batcher, self.tokenizer, self.sampling = batcher, tokenizer, sampling
        self.media_processor, self.media_limits = media_processor, media_limits or MediaLimits()
        self.model_name, self.host = model_name, host
        self.max_context_tokens = max_context_tokens
        self.max_body_bytes, self.max_json_depth = max_body_bytes, max_json_depth
        if "." in check_token(token, "AgentProxy"):
            raise ValueError("AgentProxy token must not contain '.', which separates it from a session's part")
        self.token = token
        self.sessions = SessionStore(ttl_s, key_prefix=token + ".")
        self.port = 0
        self.limits = limits or PROXY_LIMITS
        self.app = self._build_app()
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def _trusts(self, header: str | None) -> bool:
        """Whether an Authorization header carries the token (bare or with a session's part), as
        RequireToken checks it: the connection limits count connections without it per address."""
        return bearer_matches(header.partition(".")[0] if header else None, self.token)

    async def start(self) -> None:
        import uvicorn

        # Bind the socket here so the port is known before the server task runs.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        busy = _error(503, f"the proxy has {self.limits.max_connections} connections open, its limit; retry in a "
                           "second")
        config = uvicorn_config(self.app, self.limits, trusts=self._trusts, busy_body=json.loads(busy.body))
        self._server = uvicorn.Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the server's start-up error
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task

    def _build_app(self) -> FastAPI:
        # FastAPI reads the handlers' annotations, so Request must be importable at module level.
        app = FastAPI(title="relax-hpc agent proxy", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(RequireToken, token=self.token)

        def key_of(request: Request) -> str | None:
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None

        @app.get("/v1/models")
        async def models() -> JSONResponse:  # the token (RequireToken) is enough: nothing per session
            return JSONResponse({"object": "list", "data": [
                {"id": self.model_name, "object": "model", "created": 0, "owned_by": "relax-hpc"}]})

        @app.get("/v1/chat/completions/{completion_id}")
        async def get_completion(completion_id: str, request: Request) -> JSONResponse:
            try:
                session = self.sessions.lookup(key_of(request))
            except SessionAuthError as e:
                return _error(401, str(e))
            record = session.find(completion_id)
            if record is None:  # another session's id looks exactly like an unknown one
                return _error(404, f"no completion {completion_id!r} in this session")
            return JSONResponse(self._response(record))

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> JSONResponse:
            try:
                session = self.sessions.lookup(key_of(request))
            except SessionAuthError as e:
                return _error(401, str(e))
            try:
                raw = await read_limited_body(request, self.max_body_bytes, "this proxy")
                try:
                    body = load_json_body(raw, self.max_json_depth)
                except JsonBodyError as e:
                    raise RequestError(400, str(e)) from None
                req = parse_chat_request(body)
                record = await self._complete(req, session=id(session))
            except RequestError as e:
                return _error(e.status, e.message)
            try:
                session = self.sessions.lookup(key_of(request))  # it may have expired meanwhile
            except SessionAuthError as e:
                return _error(401, str(e))
            session.completions.append(record)
            return JSONResponse(self._response(record))

        return app

    async def _complete(self, req: ChatRequest, session: int | None = None) -> CompletionRecord:
        media = await self._load_media(req)
        try:
            text = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template may reject a role order; that is the caller's to fix
            raise RequestError(400, f"the chat template rejected these messages: {e}") from e
        prompt_ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if media:
            try:
                prompt_ids = self.media_processor.expand(prompt_ids, media)
            except MediaError as e:
                raise RequestError(400, f"the chat template did not write one placeholder per medium: {e}") from e
        limit = self.sampling.max_new_tokens
        max_new = min(limit, req.max_tokens) if req.max_tokens is not None else limit
        if self.max_context_tokens is not None and len(prompt_ids) + max_new > self.max_context_tokens:
            raise RequestError(400, f"prompt of {len(prompt_ids)} tokens + max_tokens {max_new} exceeds the "
                                    f"model's context of {self.max_context_tokens} tokens")
        params = SamplingParams(**{**self.sampling.__dict__, "max_new_tokens": max_new,
                                   "stop": tuple(self.sampling.stop) + req.stop})
        # One engine per session; the media go along (the whole conversation's, every turn).
        gen = await self.batcher.generate(prompt_ids, params, session=session, media=media)
        return CompletionRecord(f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, list(gen.token_ids),
                                list(gen.logprobs), gen.finish_reason, gen.weight_version, gen.text, media)

    async def _load_media(self, req: ChatRequest) -> PromptMedia | None:
        """The request's media, decoded and fitted to the model; None for a text model, whose
        samples carry no media. Decoding runs in a thread: the event loop keeps serving."""
        processor = self.media_processor
        if processor is None:
            if req.media:
                raise RequestError(400, f"{req.media[0].where}: the model reads text only; send text content, "
                                        f"or serve a multimodal model ({supported_model_types()})")
            return None
        if not req.media:
            return PromptMedia()  # every sample of a multimodal model carries media, maybe none
        try:
            items = await asyncio.to_thread(
                lambda: [load_part(part, processor, self.media_limits) for part in req.media])
        except PartError as e:
            raise RequestError(400, str(e)) from None
        return prompt_media(items)

    def _response(self, r: CompletionRecord) -> dict[str, Any]:
        return {
            "id": r.completion_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                         "finish_reason": r.finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": len(r.prompt_ids), "completion_tokens": len(r.response_ids),
                      "total_tokens": len(r.prompt_ids) + len(r.response_ids)},
        }
