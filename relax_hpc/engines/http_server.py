"""Serve any `RolloutEngine` over HTTP with the subset of SGLang's native API that rollout uses.

One client (`relax_hpc.engines.http_client.HttpEngine`) then talks to this server and to real
SGLang servers alike: a judge model on its own node, a teacher, or a native engine on a machine
without Ray. Standard library only (`http.server`), one thread per connection; generation is
serialised because engines are not required to be thread-safe.

Routes (see docs/engines.md for the full field list):

    POST /generate                {"input_ids": [...] | [[...], ...], "sampling_params": {...},
                                   "return_logprob": true, "seed": 7}
    GET  /health                  200 {"status": "ok"}
    GET  /model_info              {"model_path", "tokenizer_path", "is_generation", "weight_version", ...}
    GET  /get_model_info          the same (SGLang's older name)

Run it as `relax-hpc serve-engine MODEL_DIR --port 0`, or in a test:

    with EngineServer(engine, model_info={"model_path": str(path)}) as server:
        HttpEngine(server.url).generate(...)
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from relax_hpc.engines.base import Generation, RolloutEngine, SamplingParams

__all__ = [
    "GREEDY_TEMPERATURE",
    "EngineServer",
    "GenerateRequest",
    "RequestError",
    "generation_to_sglang",
    "parse_generate_request",
]

log = logging.getLogger(__name__)

# SGLang reads temperature 0 as greedy decoding; the native sampler needs a positive temperature,
# and at this one the softmax is one-hot in float32 for any realistic logit gap.
GREEDY_TEMPERATURE = 1e-5
# A request larger than this is refused (413) before it is read: 64 MiB is ~8M token ids as JSON.
MAX_BODY_BYTES = 64 * 1024 * 1024

SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "sampling_seed")
# Top-level SGLang fields that change nothing here and are accepted so SGLang clients work as they are.
IGNORED_KEYS = ("rid", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "stream")
REQUEST_KEYS = ("input_ids", "sampling_params", "return_logprob", "seed", *IGNORED_KEYS)


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


def _parse_prompts(body: dict[str, Any], vocab_size: int | None) -> tuple[list[list[int]], bool]:
    if "input_ids" not in body:
        hint = " (this server takes token ids, not text: tokenize on the client)" if "text" in body else ""
        raise RequestError(f"missing 'input_ids': send a list of token ids or a list of such lists{hint}")
    ids = body["input_ids"]
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
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


def parse_generate_request(body: Any, vocab_size: int | None = None) -> GenerateRequest:
    """Validate a decoded `POST /generate` body; RequestError says what is wrong."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object with 'input_ids', got {_show(body)}")
    prompts, batched = _parse_prompts(body, vocab_size)  # first: a text request gets the tokenize hint
    unknown = sorted(set(body) - set(REQUEST_KEYS))
    if unknown:
        raise RequestError(f"unsupported request keys {unknown}; supported: {list(REQUEST_KEYS)}")
    if body.get("stream"):
        raise RequestError("'stream': true is not supported; send the request without streaming")
    params, sampling_seed = _parse_sampling(body.get("sampling_params"))
    seed = body.get("seed", sampling_seed)
    if seed is not None and not _is_int(seed):
        raise RequestError(f"seed must be an integer, got {_show(seed)}")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise RequestError(f"return_logprob must be true or false, got {_show(return_logprob)}")
    return GenerateRequest(prompts, params, seed, return_logprob, batched)


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
    """An HTTP server in front of one engine; `start()` serves from a background thread."""

    def __init__(
        self,
        engine: RolloutEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        model_info: dict[str, Any] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.engine = engine
        self.model_info = dict(model_info or {})
        self.vocab_size = vocab_size
        self._generate_lock = threading.Lock()
        self._request_count = 0
        self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else str(host)
        return f"http://{shown}:{port}"

    def start(self) -> EngineServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="engine-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until interrupted (the CLI)."""
        try:
            self._httpd.serve_forever()
        finally:
            self._httpd.server_close()

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def info(self) -> dict[str, Any]:
        return {"is_generation": True, **self.model_info, "weight_version": self.engine.weight_version}

    def generate(self, body: Any) -> Any:
        """Answer one decoded `/generate` body (RequestError for a bad one)."""
        request = parse_generate_request(body, self.vocab_size)
        with self._generate_lock:
            self._request_count += 1
            rid = f"req-{self._request_count}"
            gens = self.engine.generate(request.prompts, request.params, seed=request.seed)
        if len(gens) != len(request.prompts):
            raise RuntimeError(f"the engine returned {len(gens)} generations for {len(request.prompts)} prompts")
        answers = [generation_to_sglang(g, request.return_logprob, f"{rid}-{i}") for i, g in enumerate(gens)]
        return answers if request.batched else answers[0]


def _make_handler(server: EngineServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client may send many requests on one socket

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

        def _reply(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._reply(status, {"error": {"message": message, "code": status}})

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/health":
                self._reply(HTTPStatus.OK, {"status": "ok"})
            elif path in ("/model_info", "/get_model_info"):
                self._reply(HTTPStatus.OK, server.info())
            elif path == "/generate":
                self._error(HTTPStatus.METHOD_NOT_ALLOWED, "use POST for /generate")
            else:
                self._not_found(path)

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path != "/generate":
                self._drain()
                self._not_found(path)
                return
            try:
                body = self._read_json()
            except RequestError as e:
                self.close_connection = True  # the unread rest of the body would poison the socket
                self._error(e.status, str(e))
                return
            try:
                self._reply(HTTPStatus.OK, server.generate(body))
            except RequestError as e:
                self._error(e.status, str(e))
            except Exception as e:  # an engine failure: short message, the traceback stays in the log
                log.exception("generation failed")
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"engine failed: {type(e).__name__}: {e}"[:500])

        def do_PUT(self) -> None:
            self._drain()
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, "only GET /health, GET /model_info and POST /generate exist")

        do_DELETE = do_PATCH = do_PUT

        def _not_found(self, path: str) -> None:
            routes = "POST /generate, GET /health, GET /model_info"
            self._error(HTTPStatus.NOT_FOUND, f"no route {path!r}; routes: {routes}")

        def _length(self) -> int:
            raw = self.headers.get("Content-Length")
            try:
                length = int(raw) if raw is not None else 0
            except ValueError:
                raise RequestError(f"Content-Length {raw!r} is not a number") from None
            return max(length, 0)

        def _drain(self) -> None:
            try:
                length = self._length()
            except RequestError:
                self.close_connection = True
                return
            if length > MAX_BODY_BYTES:
                self.close_connection = True
            elif length:
                self.rfile.read(length)

        def _read_json(self) -> Any:
            if self.headers.get("Content-Length") is None:
                raise RequestError("the request needs a Content-Length header and a JSON body",
                                   HTTPStatus.LENGTH_REQUIRED)
            length = self._length()
            if length > MAX_BODY_BYTES:
                raise RequestError(f"the body is {length} bytes; at most {MAX_BODY_BYTES} are accepted",
                                   HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            raw = self.rfile.read(length)
            try:
                return json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise RequestError(f"the body is not valid JSON: {e}") from None

    return Handler
