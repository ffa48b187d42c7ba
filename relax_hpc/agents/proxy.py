"""An OpenAI-compatible HTTP proxy in front of a rollout engine that records every completion.

Serves `POST /v1/chat/completions`, `GET /v1/chat/completions/{id}`, `POST /v1/responses`,
`GET /v1/responses/{id}` (the Responses API on the same path: `responses.py`) and `GET /v1/models`. Every
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

Native tool calls (`tools`, `tool_choice`; `tools.py`): the template renders the tools, the reply
is parsed for tool-call blocks, and replies that have a block it cannot read are counted in
`malformed_tool_calls`. `stream = true` streams the whole completion as chunks once it is made
(`streaming.py`); `n > 1` generates n choices, each recorded as a completion of its own.

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
from fastapi.responses import JSONResponse, Response, StreamingResponse
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
from relax_hpc.agents.responses import assistant_message, response_object, responses_turn
from relax_hpc.agents.sessions import SessionAuthError, SessionStore
from relax_hpc.agents.streaming import completion_events
from relax_hpc.agents.tools import ToolRequest, parse_reply, parse_tools, template_tool_calls
from relax_hpc.auth import bearer_matches, job_secret
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.http.auth import check_token
from relax_hpc.engines.http.body import JsonBodyError, RequestRefused, load_json_body, read_limited_body
from relax_hpc.engines.http.serving import ServingLimits, uvicorn_config
from relax_hpc.media.families import supported_model_types
from relax_hpc.media.items import MediaError, PromptMedia
from relax_hpc.media.load import DEFAULT_MEDIA_LIMITS, MediaLimits

# A chat request's body: 8 MiB is about 2M tokens of text, far beyond any model's context, or a
# few images inline (a multi-turn request re-sends every image of the conversation so far).
MAX_BODY_BYTES = 8 * 1024 * 1024
# Messages with text parts nest 5 levels; the limit leaves room for fields the proxy ignores.
MAX_JSON_DEPTH = 32
# Agents on this host: a request has 30 s to arrive (an 8 MiB body of images included), 256
# connections may be open (many sessions at once), 128 from one address before they show the token
# (every agent comes from 127.0.0.1, and a connection is without it only until its headers are in:
# inline agents share the proxy's event loop, so a step's sessions all connect before any of their
# headers is read, and a step of 8 prompts x 8 samples opens 64 at once).
PROXY_LIMITS = ServingLimits(request_timeout_s=30.0, max_connections=256, max_untrusted_per_peer=128)
MAX_CHOICES = 16  # n: the most choices one request may ask for
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
    n: int = 1  # choices, each generated and recorded on its own
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a usage chunk before [DONE]
    tools: ToolRequest | None = None  # None: no tools rendered, none parsed


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
    n, stream = body.get("n", 1), body.get("stream", False)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(400, f"n = {str(n)[:40]}: must be an integer from 1 to {MAX_CHOICES}")
    if not isinstance(stream, bool) and stream is not None:
        raise RequestError(400, f"stream = {str(stream)[:40]!r}: must be true or false")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(400, 'stream_options must be an object like {"include_usage": true}')
    tools = parse_tools(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects")
    parsed, media = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise RequestError(400, f"messages[{i}] must be an object with role one of {', '.join(_ROLES)}")
        content, parts = _content(m.get("content"), f"messages[{i}]", str(m["role"]))
        parsed.append(_tool_fields(m, f"messages[{i}]", {"role": str(m["role"]), "content": content}))
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
    return ChatRequest(parsed, max_tokens, stops, tuple(media), n, bool(stream),
                       bool(options.get("include_usage", False)), tools)


def _tool_fields(m: dict[str, Any], where: str, out: dict[str, Any]) -> dict[str, Any]:
    """`out` with the message's tool-call fields, for the template: an assistant's `tool_calls`,
    a tool result's `tool_call_id` (and `name`)."""
    if m["role"] == "assistant" and m.get("tool_calls"):
        out["tool_calls"] = template_tool_calls(m["tool_calls"], where)
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise RequestError(400, f"{where}.tool_call_id must be the id of the tool call this message answers")
        out["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


class AgentProxy:
    """The HTTP proxy; start it inside the event loop that owns `batcher`. `media_processor`: the
    model's `relax_hpc.media.processor.MediaProcessor` (None: a text model, which refuses media)."""

    def __init__(self, batcher: EngineBatcher, tokenizer: Any, sampling: SamplingParams, *, token: str,
                 model_name: str = "policy", ttl_s: float = 600.0, host: str = "127.0.0.1",
                 max_context_tokens: int | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 max_json_depth: int = MAX_JSON_DEPTH, media_processor: Any = None,
                 media_limits: MediaLimits | None = None, limits: ServingLimits | None = None) -> None:
        self.batcher, self.tokenizer, self.sampling = batcher, tokenizer, sampling
        self.media_processor, self.media_limits = media_processor, media_limits or DEFAULT_MEDIA_LIMITS
        self.model_name, self.host = model_name, host
        self.max_context_tokens = max_context_tokens
        self.max_body_bytes, self.max_json_depth = max_body_bytes, max_json_depth
        if "." in check_token(token, "AgentProxy"):
            raise ValueError("AgentProxy token must not contain '.', which separates it from a session's part")
        self.token = token
        self.sessions = SessionStore(ttl_s, key_prefix=token + ".")
        self.malformed_tool_calls = 0  # replies with a tool-call block that could not be read, so far
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

        def session_of(request: Request) -> Any:
            """The request's session, or the 401 response that names why there is none."""
            try:
                return self.sessions.lookup(key_of(request))
            except SessionAuthError as e:
                return _error(401, str(e))

        @app.get("/v1/chat/completions/{completion_id}")
        async def get_completion(completion_id: str, request: Request) -> JSONResponse:
            session = session_of(request)
            if isinstance(session, Response):
                return session
            record = session.find(completion_id)
            # A response of n > 1 choices is recorded as <id>-0, <id>-1, ...: its id names them all.
            records = [record] if record is not None else [
                r for r in session.completions if r.completion_id.startswith(completion_id + "-")]
            if not records:  # another session's id looks exactly like an unknown one
                return _error(404, f"no completion {completion_id!r} in this session")
            return JSONResponse(self._response(completion_id, records))

        async def read_json(request: Request) -> Any:
            raw = await read_limited_body(request, self.max_body_bytes, "this proxy")
            try:
                return load_json_body(raw, self.max_json_depth)
            except JsonBodyError as e:
                raise RequestError(400, str(e)) from None

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            session = session_of(request)
            if isinstance(session, Response):
                return session
            try:
                req = parse_chat_request(await read_json(request))
                response_id, records = await self._complete(req, session=id(session))
            except RequestError as e:
                return _error(e.status, e.message)
            session = session_of(request)  # it may have expired meanwhile
            if isinstance(session, Response):
                return session
            session.completions.extend(records)  # recorded before a stream starts: the same either way
            response = self._response(response_id, records)
            if req.stream:
                return StreamingResponse(completion_events(response, req.include_usage),
                                         media_type="text/event-stream")
            return JSONResponse(response)

        @app.post("/v1/responses")
        async def responses(request: Request) -> Response:
            session = session_of(request)
            if isinstance(session, Response):
                return session
            try:
                turn = responses_turn(await read_json(request), session.conversations)
                response_id, [record] = await self._complete(parse_chat_request(turn.chat_body), id(session),
                                                             id_prefix="resp_")
            except RequestError as e:
                return _error(e.status, e.message)
            session = session_of(request)  # it may have expired meanwhile
            if isinstance(session, Response):
                return session
            session.completions.append(record)
            response = response_object(response_id, record, turn, self.model_name)
            session.responses[response_id] = response
            session.conversations[response_id] = [*turn.conversation, assistant_message(record)]
            return JSONResponse(response)

        @app.get("/v1/responses/{response_id}")
        async def get_response(response_id: str, request: Request) -> JSONResponse:
            session = session_of(request)
            if isinstance(session, Response):
                return session
            if response_id not in session.responses:  # another session's id looks exactly like an unknown one
                return _error(404, f"no response {response_id!r} in this session")
            return JSONResponse(session.responses[response_id])

        return app

    def _render(self, req: ChatRequest) -> str:
        """The prompt's text: the model's chat template over the messages and the request's tools."""
        tools = [dict(t) for t in req.tools.tools] if req.tools is not None else None
        try:
            text = self.tokenizer.apply_chat_template(req.messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False)
            bare = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                                      tokenize=False) if tools else None
        except Exception as e:  # a template may reject a role order; that is the caller's to fix
            raise RequestError(400, f"the chat template rejected these messages: {e}") from e
        if tools and text == bare:
            raise RequestError(400, "the model's chat template does not render tools (its output is the same "
                                    "with and without them): describe the tools in the messages and parse the "
                                    "reply yourself, or serve a model whose template has a tool format")
        return text

    async def _complete(self, req: ChatRequest, session: int | None = None, id_prefix: str = "chatcmpl-"
                        ) -> tuple[str, list[CompletionRecord]]:
        """The response id and one record per choice (ids <response id>-<k> when n > 1)."""
        media = await self._load_media(req)
        prompt_ids = list(self.tokenizer.encode(self._render(req), add_special_tokens=False))
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
        # One engine per session; the media go along (the whole conversation's, every turn). The
        # n choices are n prompts of the batch, each sampled with its own seed.
        gens = await asyncio.gather(*(self.batcher.generate(prompt_ids, params, session=session, media=media)
                                      for _ in range(req.n)))
        response_id = f"{id_prefix}{uuid.uuid4().hex}"
        return response_id, [
            CompletionRecord(response_id if req.n == 1 else f"{response_id}-{k}", prompt_ids, list(gen.token_ids),
                             list(gen.logprobs), gen.finish_reason, gen.weight_version, gen.text, media,
                             served=self._choice(k, gen.text, gen.finish_reason, req.tools))
            for k, gen in enumerate(gens)]

    def _choice(self, index: int, text: str, finish_reason: str, tools: ToolRequest | None) -> dict[str, Any]:
        """A choice as served: the text, or the tool calls parsed from it (finish "tool_calls")."""
        plain = {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        if tools is None:
            return plain
        reply = parse_reply(text, tools.names)
        if reply.malformed:
            self.malformed_tool_calls += 1
        if not reply.tool_calls:
            return plain
        # Cut at max_tokens after whole calls: "length" still, so the agent knows the turn was cut.
        return {"index": index, "finish_reason": "length" if finish_reason == "length" else "tool_calls",
                "message": {"role": "assistant", "content": reply.content,
                            "tool_calls": [c.as_openai() for c in reply.tool_calls]}}

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

    def _response(self, response_id: str, records: list[CompletionRecord]) -> dict[str, Any]:
        """A chat.completion of `records` (one per choice, all of one prompt)."""
        choices = [{**(r.served or self._choice(0, r.text, r.finish_reason, None)), "logprobs": None}
                   for r in records]
        prompt, completion = len(records[0].prompt_ids), sum(len(r.response_ids) for r in records)
        return {
            "id": response_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }
