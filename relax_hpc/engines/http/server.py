"""Serve any `RolloutEngine` over HTTP with the subset of SGLang's native API that rollout uses.

One client (`relax_hpc.engines.http.client.HttpEngine`) then talks to this server and to real
SGLang servers alike: a judge model on its own node, a teacher, or a native engine on a machine
without Ray. FastAPI on uvicorn, like the REST API and the agent proxy, under the same connection
limits (http/serving.py); generation runs in one worker thread, serialised, because engines are
not required to be thread-safe.

`ServerLimits` bounds what one client can take: connections (in all, and per address before
they show the token), the time a request may take to arrive, the body's size and nesting, and
the prompts and tokens of one `/generate`. Every request needs `Authorization: Bearer <token>`
(`http/auth.py`): without it, any path or method, the answer is 401 before the body is read.

Routes (see docs/engines.md for the full field list):

    POST /generate                {"input_ids": [...] | [[...], ...], "sampling_params": {...},
                                   "return_logprob": true, "seed": 7}
    GET  /health                  200 {"status": "ok"}
    GET  /model_info              {"model_path", "tokenizer_path", "is_generation", "weight_version", ...}
    GET  /get_model_info          the same (SGLang's older name)
    POST /update_weights_from_disk {"model_path": "<weights_root>/v3", "weight_version": 3}
                                  -> {"success": true, "message": "...", "weight_version": 3}

`/update_weights_from_disk` (SGLang's route and body) loads a directory of safetensors files that
the training job wrote (disk_weights.py) into the engine, only on a server started with
`weights_root` (`--weights-root`) and only from a directory inside it. Every tensor is read and
checked against the model's names and shapes before any is copied in, so a refused load leaves
the old weights serving; the copy holds the generate lock, so no generation sees half of it.

Run it as `relax-hpc serve-engine MODEL_DIR --port 0`, or in a test:

    with EngineServer(engine, token=token, model_info={"model_path": str(path)}) as server:
        HttpEngine(server.url, token=token).generate(...)
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from relax_hpc.auth import bearer_matches
from relax_hpc.engines.base import Generation, RolloutEngine, SamplingParams
from relax_hpc.engines.disk_weights import WeightsDirError, parameter_shapes, read_weights_dir, resolve_weights_dir
from relax_hpc.engines.http.auth import ENGINE_AUTH_MESSAGE, check_token
from relax_hpc.engines.http.body import JsonBodyError, declared_length, load_json_body
from relax_hpc.engines.http.serving import ServingLimits, UvicornThread, bearer_trust, uvicorn_config

__all__ = [
    "GREEDY_TEMPERATURE",
    "EngineServer",
    "GenerateRequest",
    "JsonBodyError",
    "RequestError",
    "ServerLimits",
    "exposure_warning",
    "generation_to_sglang",
    "load_json_body",  # from http_body, where the proxy and the REST API take it too
    "parse_disk_update_request",
    "parse_generate_request",
]

log = logging.getLogger(__name__)

# SGLang reads temperature 0 as greedy decoding; the native sampler needs a positive temperature,
# and at this one the softmax is one-hot in float32 for any realistic logit gap.
GREEDY_TEMPERATURE = 1e-5

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "sampling_seed")
# Top-level SGLang fields that change nothing here and are accepted so SGLang clients work as they are.
IGNORED_KEYS = ("rid", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "stream")
REQUEST_KEYS = ("input_ids", "sampling_params", "return_logprob", "seed", *IGNORED_KEYS)
POST_ROUTES = ("/generate", "/update_weights_from_disk")
ROUTES = "POST /generate, GET /health, GET /model_info, POST /update_weights_from_disk"


@dataclass(frozen=True)
class ServerLimits:
    """What one client may take from an `EngineServer` (`relax-hpc serve-engine` sets each one)."""

    request_timeout_s: float = 30.0  # a request must arrive whole within this; idle keep-alive ends after it
    max_connections: int = 64  # open connections; the next one is answered 503
    max_untrusted_per_peer: int = 16  # connections of one address before it shows the token; the oldest goes
    max_body_bytes: int = 8 * 1024 * 1024  # checked from Content-Length before reading (~1M token ids)
    max_json_depth: int = 32  # a /generate body needs 3 levels
    max_prompts: int = 256  # prompts in one /generate
    max_request_prompt_tokens: int = 262_144  # token ids of all the prompts of one /generate together
    max_request_new_tokens: int = 32_768  # sampling_params.max_new_tokens; the KV cache is sized by it

    def __post_init__(self) -> None:
        problems = []
        for field in fields(self):
            value = getattr(self, field.name)
            name = f"{field.name} ({LIMIT_FLAGS[field.name]})" if field.name in LIMIT_FLAGS else field.name
            if field.name == "request_timeout_s":
                if not _is_number(value) or value <= 0:
                    problems.append(f"{name} must be a number of seconds > 0, got {value!r}")
            elif not _is_int(value) or value < 1:
                problems.append(f"{name} must be an integer >= 1, got {value!r}")
        if problems:
            raise ValueError("engine server limits: " + "; ".join(problems))


# The serve-engine option of each limit, for error messages (max_json_depth has none).
LIMIT_FLAGS = {
    "request_timeout_s": "--request-timeout-s",
    "max_connections": "--max-connections",
    "max_untrusted_per_peer": "--max-untrusted-per-peer",
    "max_body_bytes": "--max-body-bytes",
    "max_prompts": "--max-prompts",
    "max_request_prompt_tokens": "--max-prompt-tokens",
    "max_request_new_tokens": "--max-new-tokens",
}


def exposure_warning(host: str, port: int) -> str | None:
    """The warning to print when the server listens beyond this machine (None on loopback)."""
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: it may resolve to any interface
        pass
    return (
        f"warning: the engine server listens on {host}:{port}, which is not a loopback address, and speaks "
        "plain HTTP: anyone who can watch the network between it and a client can read the bearer token "
        "and the prompts. Use it only on a network where every host is trusted, or serve on 127.0.0.1 "
        "(the default) and reach it through an SSH tunnel (ssh -L)."
    )


class RequestError(ValueError):
    """A request the server refuses; the message says which field is wrong and what is allowed."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GenerateRequest:
    """A validated `POST /generate` body."""

    prompts: list[list[int]]
    params: SamplingParams
    seed: int | None
    return_logprob: bool
    batched: bool  # input_ids was a list of lists: the reply is a list too


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _token_list(value: Any, where: str, vocab_size: int | None) -> list[int]:
    if not isinstance(value, list) or not value:
        raise RequestError(f"{where} must be a non-empty list of token ids (integers), got {_show(value)}")
    for token in value:
        if not _is_int(token) or token < 0 or (vocab_size is not None and token >= vocab_size):
            limit = f" below the vocabulary size {vocab_size}" if vocab_size is not None else ""
            raise RequestError(f"{where} holds {_show(token)}; token ids are integers >= 0{limit}")
    return list(value)


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _parse_prompts(body: dict[str, Any], vocab_size: int | None,
                   limits: ServerLimits) -> tuple[list[list[int]], bool]:
    if "input_ids" not in body:
        hint = " (this server takes token ids, not text: tokenize on the client)" if "text" in body else ""
        raise RequestError(f"missing 'input_ids': send a list of token ids or a list of such lists{hint}")
    ids = body["input_ids"]
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    if batched and len(ids) > limits.max_prompts:
        raise RequestError(f"input_ids holds {len(ids)} prompts; this server takes at most {limits.max_prompts} "
                           f"in one request ({LIMIT_FLAGS['max_prompts']}): split the batch")
    if batched:
        total = sum(len(p) if isinstance(p, list) else 1 for p in ids)
    else:
        total = len(ids) if isinstance(ids, list) else 0
    if total > limits.max_request_prompt_tokens:
        raise RequestError(f"input_ids holds {total} prompt tokens in all; this server takes at most "
                           f"{limits.max_request_prompt_tokens} in one request ({LIMIT_FLAGS['max_request_prompt_tokens']})")
    if batched:
        return [_token_list(p, f"input_ids[{i}]", vocab_size) for i, p in enumerate(ids)], True
    return [_token_list(ids, "input_ids", vocab_size)], False


def _parse_strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) and s for s in value):
        return tuple(value)
    raise RequestError(f"sampling_params.stop must be a string or a list of non-empty strings, got {_show(value)}")


def _parse_sampling(raw: Any) -> tuple[SamplingParams, int | None]:
    """SamplingParams and the optional `sampling_seed` from SGLang-style sampling params."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(
            f"sampling_params must be one JSON object (the same for every prompt), got {_show(raw)}"
        )
    unknown = sorted(set(raw) - set(SAMPLING_KEYS))
    if unknown:
        raise RequestError(f"sampling_params has unsupported keys {unknown}; supported: {list(SAMPLING_KEYS)}")
    fields: dict[str, Any] = {}
    for key in ("max_new_tokens", "top_k"):
        if key in raw:
            if not _is_int(raw[key]):
                raise RequestError(f"sampling_params.{key} must be an integer, got {_show(raw[key])}")
            fields[key] = raw[key]
    if fields.get("top_k") == -1:  # SGLang's "no top-k"; ours is 0
        fields["top_k"] = 0
    for key in ("temperature", "top_p"):
        if key in raw:
            if not _is_number(raw[key]):
                raise RequestError(f"sampling_params.{key} must be a finite number, got {_show(raw[key])}")
            fields[key] = float(raw[key])
    if fields.get("temperature") == 0.0:
        fields["temperature"] = GREEDY_TEMPERATURE
    if "stop" in raw and raw["stop"] is not None:
        fields["stop"] = _parse_strings(raw["stop"])
    if "stop_token_ids" in raw and raw["stop_token_ids"] is not None:
        ids = raw["stop_token_ids"]
        if not isinstance(ids, list) or not all(_is_int(t) and t >= 0 for t in ids):
            raise RequestError(f"sampling_params.stop_token_ids must be a list of token ids, got {_show(ids)}")
        fields["stop_token_ids"] = tuple(ids)
    seed = raw.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"sampling_params.sampling_seed must be an integer, got {_show(seed)}")
    try:
        return SamplingParams(**fields), seed
    except ValueError as e:  # the ranges: max_new_tokens >= 1, 0 < top_p <= 1, ...
        raise RequestError(f"sampling_params: {e}") from e


def parse_generate_request(body: Any, vocab_size: int | None = None,
                           limits: ServerLimits | None = None) -> GenerateRequest:
    """Validate a decoded `POST /generate` body; RequestError says what is wrong."""
    limits = limits or ServerLimits()
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object with 'input_ids', got {_show(body)}")
    prompts, batched = _parse_prompts(body, vocab_size, limits)  # first: a text request gets the tokenize hint
    unknown = sorted(set(body) - set(REQUEST_KEYS))
    if unknown:
        raise RequestError(f"unsupported request keys {unknown}; supported: {list(REQUEST_KEYS)}")
    if body.get("stream"):
        raise RequestError("'stream': true is not supported; send the request without streaming")
    params, sampling_seed = _parse_sampling(body.get("sampling_params"))
    if params.max_new_tokens > limits.max_request_new_tokens:
        given = "" if "max_new_tokens" in (body.get("sampling_params") or {}) else " (the default)"
        raise RequestError(f"sampling_params.max_new_tokens = {params.max_new_tokens}{given} is over this "
                           f"server's limit of {limits.max_request_new_tokens} ({LIMIT_FLAGS['max_request_new_tokens']})")
    seed = body.get("seed", sampling_seed)
    if seed is not None and not _is_int(seed):
        raise RequestError(f"seed must be an integer, got {_show(seed)}")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise RequestError(f"return_logprob must be true or false, got {_show(return_logprob)}")
    return GenerateRequest(prompts, params, seed, return_logprob, batched)


def parse_disk_update_request(body: Any) -> tuple[str, int]:
    """`model_path` and `weight_version` of a decoded `POST /update_weights_from_disk` body.

    SGLang sends the version as a string ("3"), which is read as its number. SGLang's other keys
    (flush_cache, load_format, abort_all_requests, ...) vary between its releases and change
    nothing here, so any other key is ignored."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object with 'model_path' and 'weight_version', got {_show(body)}")
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise RequestError("model_path must be the path of a directory of *.safetensors files under this server's "
                           f"--weights-root, got {_show(path)}")
    version = body.get("weight_version")
    if isinstance(version, str) and version.isascii() and version.isdigit() and len(version) <= 18:
        version = int(version)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise RequestError("weight_version must be an integer >= 0 (or its decimal string, as SGLang clients send "
                           f"it): the version later generations report, got {_show(version)}")
    return path, version


def generation_to_sglang(gen: Generation, return_logprob: bool, request_id: str) -> dict[str, Any]:
    """One prompt's answer in SGLang's `/generate` shape."""
    finish: dict[str, Any] = {"type": gen.finish_reason}
    if gen.finish_reason == "length":
        finish["length"] = len(gen.token_ids)
    meta: dict[str, Any] = {
        "id": request_id,
        "finish_reason": finish,
        "prompt_tokens": len(gen.prompt_ids),
        "completion_tokens": len(gen.token_ids),
        "cached_tokens": 0,
        "weight_version": gen.weight_version,
    }
    if return_logprob:
        # SGLang's triple is (logprob, token id, token text or null without return_text_in_logprobs).
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(gen.logprobs, gen.token_ids)]
    return {"text": gen.text, "output_ids": list(gen.token_ids), "meta_info": meta}


class EngineServer:
    """An HTTP server in front of one engine; `start()` serves from a background thread.

    `token` is the bearer token every request must carry: `engine_token()` (http/auth.py) in a
    job, a fresh one for `relax-hpc serve-engine` run by hand. `weights_root`: the directory
    whose weight versions `/update_weights_from_disk` may load; None refuses every update. The
    port is bound here (OSError when it is taken), so `port` and `url` are known before `start()`."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        model_info: dict[str, Any] | None = None,
        vocab_size: int | None = None,
        limits: ServerLimits | None = None,
        weights_root: str | Path | None = None,
    ) -> None:
        if weights_root is not None and not Path(weights_root).is_dir():
            raise ValueError(f"weights root {weights_root} (--weights-root) is not a directory; create it, or pass "
                             "the directory the training job writes its weight versions to")
        self.weights_root = Path(weights_root).resolve() if weights_root is not None else None
        self.engine = engine
        self.token = check_token(token, "EngineServer")
        self.model_info = dict(model_info or {})
        self.vocab_size = vocab_size
        self.limits = limits or ServerLimits()
        self._generate_lock = threading.Lock()
        self._update_lock = threading.Lock()  # one weight load at a time: versions land in the order asked
        self._request_count = 0
        # Engine calls run in one thread (engines need not be thread-safe), weight loads in another
        # (reading a version's files does not hold generation up); never on the event loop.
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-generate")
        self._update_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-update")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=128)  # OSError: the CLI names it
        serving = ServingLimits(request_timeout_s=self.limits.request_timeout_s,
                                max_connections=self.limits.max_connections,
                                max_untrusted_per_peer=self.limits.max_untrusted_per_peer)
        busy = (f"the engine server is serving its limit of {self.limits.max_connections} connections "
                f"({LIMIT_FLAGS['max_connections']}); retry later")
        config = uvicorn_config(_engine_app(self), serving, trusts=bearer_trust(self.token),
                                busy_body={"error": {"message": busy, "code": HTTPStatus.SERVICE_UNAVAILABLE}})
        self._address = sock.getsockname()[:2]
        self._runner = UvicornThread(config, host, port, "the engine server", sock=sock)

    @property
    def port(self) -> int:
        return int(self._address[1])

    @property
    def url(self) -> str:
        host, port = self._address
        shown = f"[{host}]" if ":" in str(host) else str(host)
        return f"http://{shown}:{port}"

    @property
    def open_connections(self) -> int:
        """Connections the server holds now (http/serving.py)."""
        return self._runner.open_connections

    def start(self) -> EngineServer:
        self._runner.start()
        return self

    def serve_forever(self) -> None:
        """Serve until interrupted (the CLI: Ctrl-C, or SIGTERM turned into KeyboardInterrupt)."""
        self.start()
        try:
            while not self._runner.join(0.5):
                pass
        finally:
            self.stop()

    def stop(self) -> None:
        self._runner.stop()
        self._engine_thread.shutdown(wait=False, cancel_futures=True)
        self._update_thread.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def info(self) -> dict[str, Any]:
        return {"is_generation": True, **self.model_info, "weight_version": self.engine.weight_version}

    def generate(self, body: Any) -> Any:
        """Answer one decoded `/generate` body (RequestError for a bad one)."""
        request = parse_generate_request(body, self.vocab_size, self.limits)
        with self._generate_lock:
            self._request_count += 1
            rid = f"req-{self._request_count}"
            gens = self.engine.generate(request.prompts, request.params, seed=request.seed)
        if len(gens) != len(request.prompts):
            raise RuntimeError(f"the engine returned {len(gens)} generations for {len(request.prompts)} prompts")
        answers = [generation_to_sglang(g, request.return_logprob, f"{rid}-{i}") for i, g in enumerate(gens)]
        return answers if request.batched else answers[0]

    def update_weights_from_disk(self, body: Any) -> dict[str, Any]:
        """Answer one decoded `/update_weights_from_disk` body: load the weights directory it
        names into the engine. RequestError (403 without a weights root, 400 for a bad body or
        directory) leaves the old weights serving."""
        if self.weights_root is None:
            raise RequestError("this server was started without --weights-root; it takes no weight updates. Restart "
                               "it with `relax-hpc serve-engine MODEL_DIR --weights-root DIR`, DIR the directory the "
                               "training job writes its weight versions to", HTTPStatus.FORBIDDEN)
        model_path, version = parse_disk_update_request(body)
        with self._update_lock:
            try:  # read and check everything before touching the engine
                directory = resolve_weights_dir(model_path, self.weights_root)
                named = read_weights_dir(directory, self.weights_root, parameter_shapes(self.engine))
            except WeightsDirError as e:
                raise RequestError(str(e)) from None
            with self._generate_lock:
                self.engine.update_weights(named, version)
        log.info("loaded weight version %d (%d tensors) from %s", version, len(named), directory)
        return {"success": True, "message": f"loaded {len(named)} tensors from {directory}",
                "weight_version": version}

    async def answer(self, path: str, body: Any) -> Any:
        """One decoded POST body answered in the engine's thread (generate) or the loader's (update)."""
        update = path == "/update_weights_from_disk"
        pool = self._update_thread if update else self._engine_thread
        call = self.update_weights_from_disk if update else self.generate
        return await asyncio.get_running_loop().run_in_executor(pool, call, body)


def _with_headers(response: Response, headers: dict[str, str]) -> Response:
    # Raw, so they go out spelled as http.server spelled them (Starlette lower-cases its own).
    response.raw_headers.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())
    return response


def _reply(status: int, payload: Any) -> JSONResponse:
    # A refusal sent before its request's body was read says Connection: close by the serving
    # layer (http/serving.py, CloseWhenBodyUnread), which then reads and drops the rest.
    return JSONResponse(payload, status_code=status)


def _error(status: int, message: str, *, sglang_failure: bool = False) -> JSONResponse:
    # SGLang answers a failed weight update with {"success": false, "message": ...}.
    failure = {"success": False, "message": message} if sglang_failure else {}
    return _reply(status, {**failure, "error": {"message": message, "code": status}})


class _RequireEngineToken:
    """ASGI middleware: 401 to every request, any path or method, whose `Authorization` is not
    `Bearer <token>`, from the headers alone (no body read, no "100 Continue" sent); it also
    drops a trailing slash from the path, as the routes are matched without one."""

    def __init__(self, app: ASGIApp, token: str, message: str) -> None:
        self.app, self.token = app, token
        body = json.dumps({"error": {"message": message, "code": HTTPStatus.UNAUTHORIZED}}).encode("utf-8")
        self.refusal = _with_headers(Response(body, status_code=HTTPStatus.UNAUTHORIZED, media_type="application/json"),
                                     {"WWW-Authenticate": "Bearer"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if not bearer_matches(Headers(scope=scope).get("authorization"), self.token):
            await self.refusal(scope, receive, send)
            return
        await self.app({**scope, "path": scope["path"].rstrip("/") or "/"}, receive, send)


def _length(raw: str, limits: ServerLimits) -> int:
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):  # int() would also take "-5", "+5" and "1_0"
        raise RequestError(f"Content-Length {_show(raw)} is not a byte count")
    if len(text) > 18:  # over any limit (and int() refuses more than 4300 digits)
        raise RequestError(f"Content-Length {_show(text[:40])} is over the limit of {limits.max_body_bytes} "
                           f"bytes ({LIMIT_FLAGS['max_body_bytes']})", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    return int(text)


async def _read_json(request: Request, limits: ServerLimits) -> Any:
    """The request's JSON body: 411 without a Content-Length, 413 over the limit (before a byte of it
    is read), 400 for a body that ends early, is not JSON or nests too deep."""
    raw_length = declared_length(request.headers)
    if raw_length is None:
        raise RequestError("the request needs a Content-Length header and a JSON body", HTTPStatus.LENGTH_REQUIRED)
    length = _length(raw_length, limits)
    if length > limits.max_body_bytes:
        raise RequestError(f"the body is {length} bytes; at most {limits.max_body_bytes} are accepted "
                           f"({LIMIT_FLAGS['max_body_bytes']})", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    chunks, size = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
    if size < length:
        raise RequestError(f"the body ended after {size} of its {length} bytes (Content-Length)")
    try:
        return load_json_body(b"".join(chunks), limits.max_json_depth)
    except JsonBodyError as e:
        raise RequestError(str(e)) from None


def _engine_app(server: EngineServer) -> FastAPI:
    """The routes of the module docstring, each answered as `http.server` did before it."""
    app = FastAPI(title="relax-hpc engine server", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.add_middleware(_RequireEngineToken, token=server.token, message=ENGINE_AUTH_MESSAGE)

    @app.get("/health")
    async def health() -> JSONResponse:
        return _reply(HTTPStatus.OK, {"status": "ok"})

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> JSONResponse:
        return _reply(HTTPStatus.OK, server.info())

    async def post(request: Request) -> JSONResponse:
        path = request.url.path
        update = path == "/update_weights_from_disk"
        try:
            body = await _read_json(request, server.limits)
        except RequestError as e:  # an unread rest of the body: the serving layer closes after this
            return _error(e.status, str(e))
        try:
            return _reply(HTTPStatus.OK, await server.answer(path, body))
        except RequestError as e:
            return _error(e.status, str(e), sglang_failure=update)
        except Exception as e:  # an engine failure: short message, the traceback stays in the log
            log.exception("%s failed", path)
            return _error(HTTPStatus.INTERNAL_SERVER_ERROR, f"engine failed: {type(e).__name__}: {e}"[:500],
                          sglang_failure=update)

    for route in POST_ROUTES:
        app.add_api_route(route, post, methods=["POST"])

    @app.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def elsewhere(request: Request) -> JSONResponse:
        path, method = request.url.path, request.method
        if method == "GET" and path in POST_ROUTES:
            return _error(HTTPStatus.METHOD_NOT_ALLOWED, f"use POST for {path}")
        if method in ("GET", "POST"):
            return _error(HTTPStatus.NOT_FOUND, f"no route {path!r}; routes: {ROUTES}")
        return _error(HTTPStatus.METHOD_NOT_ALLOWED, f"this server has only these routes: {ROUTES}")

    return app
