"""`HttpEngine`: a `RolloutEngine` that generates through an engine server's `POST /generate`.

The server is either `relax-hpc serve-engine` (relax_hpc.engines.http.server) or a real SGLang
server: both speak SGLang's native API. Token ids go in and come out, so the caller tokenizes
with the served model's tokenizer. Used for judges (GenRM) and other frozen models: the weights
of a remote engine are the server's business, and `update_weights` refuses.

    engine = HttpEngine("http://judge-node:30000", token=engine_token(), timeout_s=60, retries=3)
    gens = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8), seed=0)

Every request carries `Authorization: Bearer <token>`: `engine_token()` (http/auth.py) of the
job, the token file of a `serve-engine` run by hand, SGLang's `--api-key`, or None for a server
that wants none. Connection errors, timeouts, HTTP 429 and 5xx are retried with exponential
backoff. With `busy_wait_s`, a server that answers 503 or 429 (busy: its connection limit, not
a failure) is asked again, after its `Retry-After` or the backoff, for up to that long before the
attempt counts as failed; a 401 (`EngineAuthError`) says the token does not match; other 4xx replies mean the
request is wrong and fail at once with the server's message. Every error names the URL.
Redirects are not followed, so the token goes to `base_url` only (relax_hpc/ops/http.py: the
client and the retry policy every HTTP client of ours shares). Every request opens its own
connection, so a restarted server or one closing an idle connection costs no attempt (a health
check has one).
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable, Sequence

import httpx
import torch

from relax_hpc.engines.base import FinishReason, Generation, SamplingParams
from relax_hpc.ops.http import TRANSPORT_ERRORS, RetryPolicy, retry_after_s, retryable, thread_client

__all__ = ["EngineAuthError", "EngineHttpError", "HttpEngine", "parse_generate_reply"]


class EngineHttpError(RuntimeError):
    """The engine server could not be reached or gave an answer this client cannot use."""


class EngineAuthError(EngineHttpError):
    """The engine server refused this client's bearer token (HTTP 401)."""


class _Reply(Exception):
    """A reply other than 2xx, carried out of one attempt."""

    def __init__(self, reply: httpx.Response) -> None:
        super().__init__(reply.status_code)
        self.code, self.headers = reply.status_code, reply.headers
        self.message = _error_message(reply)


BUSY_CODES = (429, 503)  # the server is busy (its connection limit, a queue): ask again later
_clock, _sleep = time.monotonic, time.sleep  # patched by tests


def _weight_version(value: Any) -> int:
    # SGLang reports a string ("default" until the first update, then whatever the updater sent).
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return 0


def _one_reply(item: Any, prompt: list[int], url: str) -> Generation:
    if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        raise EngineHttpError(f"engine at {url} replied {json.dumps(item)[:200]}; expected an object with 'meta_info'")
    meta = item["meta_info"]
    pairs = meta.get("output_token_logprobs")
    if not isinstance(pairs, list):
        raise EngineHttpError(
            f"engine at {url} sent no meta_info.output_token_logprobs; the request asked for return_logprob"
        )
    logprobs = [float(p[0]) for p in pairs]
    # Older SGLang releases have no "output_ids"; the log-prob triples carry the same ids.
    token_ids = [int(t) for t in item["output_ids"]] if "output_ids" in item else [int(p[1]) for p in pairs]
    if len(token_ids) != len(logprobs):
        raise EngineHttpError(
            f"engine at {url} sent {len(token_ids)} output ids but {len(logprobs)} log-probs"
        )
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("stop", "length"):
        detail = finish.get("message", "") if isinstance(finish, dict) else ""
        raise EngineHttpError(f"engine at {url} ended a generation with finish_reason {kind!r} {detail}".rstrip())
    reason: FinishReason = "stop" if kind == "stop" else "length"
    text = item.get("text", "")
    return Generation(
        prompt_ids=list(prompt), token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
        weight_version=_weight_version(meta.get("weight_version")), text=text if isinstance(text, str) else "",
        extra={"request_id": meta.get("id")},
    )


def parse_generate_reply(body: Any, prompts: list[list[int]], url: str) -> list[Generation]:
    """Generations from a decoded batched `/generate` reply (one object per prompt)."""
    if isinstance(body, dict) and len(prompts) == 1:
        body = [body]
    if not isinstance(body, list) or len(body) != len(prompts):
        got = len(body) if isinstance(body, list) else type(body).__name__
        raise EngineHttpError(f"engine at {url} answered {got} for {len(prompts)} prompts; expected one object each")
    try:
        return [_one_reply(item, prompt, url) for item, prompt in zip(body, prompts)]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise EngineHttpError(f"engine at {url} sent a malformed generation ({type(e).__name__}: {e})") from e


def sampling_payload(params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """SGLang's sampling_params for ours (top_k 0 is SGLang's -1: no top-k filter)."""
    payload: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
    }
    if params.stop:
        payload["stop"] = list(params.stop)
    if params.stop_token_ids:
        payload["stop_token_ids"] = list(params.stop_token_ids)
    if seed is not None:
        payload["sampling_seed"] = seed
    return payload


class HttpEngine:
    """A `RolloutEngine` whose model runs behind an HTTP engine server."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        busy_wait_s: float = 0.0,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"engine URL {base_url!r} must start with http:// or https://, e.g. http://node1:30000")
        if timeout_s <= 0 or retries < 0 or busy_wait_s < 0:
            raise ValueError(f"HttpEngine needs timeout_s > 0, retries >= 0 and busy_wait_s >= 0, got {timeout_s}, "
                             f"{retries} and {busy_wait_s}")
        if token is not None and (not token or not token.isascii() or any(c.isspace() for c in token)):
            raise ValueError("HttpEngine token must be a non-empty ASCII string without spaces (the server's "
                             "bearer token), or None for a server that takes none")
        self.base_url = base_url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s
        self.policy = RetryPolicy(retries, backoff_s, max_backoff_s)
        self.busy_wait_s = busy_wait_s
        self._version = 0

    @property
    def weight_version(self) -> int:
        """The weight version of the server's last answer (0 before the first generation)."""
        return self._version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise RuntimeError(
            f"weights of an HTTP engine are updated by its server ({self.base_url}), not through this client; "
            "a judge or teacher served this way is frozen"
        )

    def health(self) -> bool:
        """True when GET /health answers 200 (one attempt, no retries); EngineAuthError when the
        server is up but refuses the token."""
        try:
            self.send("GET", "/health", None, attempts=1)
            return True
        except EngineAuthError:
            raise
        except EngineHttpError:
            return False

    def model_info(self) -> dict[str, Any]:
        # /get_model_info is the name both SGLang and relax-hpc's server answer.
        body = self.send("GET", "/get_model_info", None)
        if not isinstance(body, dict):
            raise EngineHttpError(f"engine at {self.base_url}/get_model_info replied {body!r}; expected an object")
        return body

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
        media: Sequence[Any] | None = None,
    ) -> list[Generation]:
        if media is not None and any(media):
            raise ValueError("an engine reached over HTTP does not take images, video or audio from relax-hpc "
                             'yet; run the native engine in the job ([rollout] engine = "native")')
        if not prompts:
            return []
        request = {
            "input_ids": [list(p) for p in prompts],
            "sampling_params": sampling_payload(params, seed),
            "return_logprob": True,
        }
        gens = parse_generate_reply(self.send("POST", "/generate", request), prompts, self.base_url)
        self._version = max((g.weight_version for g in gens), default=self._version)
        return gens

    def send(self, method: str, path: str, payload: Any, attempts: int | None = None) -> Any:
        """One JSON request with this client's token, retries and errors; the decoded reply
        (also the transport of `SGLangEngine`)."""
        url = self.base_url + path
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        tries = self.policy.attempts if attempts is None else attempts
        busy_until, busy_waits = _clock() + self.busy_wait_s, 0
        last, attempt = "", 0
        while True:
            try:
                return self._once(method, url, data)
            except _Reply as e:
                last = f"HTTP {e.code}: {e.message}"
                if e.code == 401:
                    raise EngineAuthError(self._auth_problem(url, last)) from None
                if e.code in BUSY_CODES and self.busy_wait_s > 0:
                    wait = retry_after_s(e.headers)
                    wait = self.policy.wait_s(busy_waits) if wait is None else wait
                    if _clock() + wait <= busy_until:  # busy, not failed: ask again, this is no attempt
                        busy_waits += 1
                        _sleep(wait)
                        continue
                    last += f" (busy for {self.busy_wait_s} s)"
                elif not retryable(e.code):
                    raise EngineHttpError(f"engine at {url} rejected the request: {last}") from None
            except TRANSPORT_ERRORS as e:
                # Also a server that died while it sent its reply (a grow job's engine cancelled
                # mid-step): a failed attempt like a refused one.
                last = f"{type(e).__name__}: {e or 'no detail'}"
            except json.JSONDecodeError as e:
                last = f"reply is not JSON ({e.msg})"
            attempt += 1
            if attempt >= tries:
                break
            _sleep(self.policy.wait_s(attempt - 1))
        raise EngineHttpError(
            f"engine at {url} failed after {tries} attempt(s) (last error: {last}); is the server up and "
            f"reachable from here? timeout_s = {self.timeout_s}"
        )

    def _auth_problem(self, url: str, reply: str) -> str:
        sent = "sent no token" if self._token is None else "sent a bearer token that does not match the server's"
        return (f"engine at {url} refused this client ({reply}): it {sent}. Pass HttpEngine(token=...) the "
                "server's token: JobSecret.token('engine-http') of the job secret the server was started with, "
                "or the contents of the token file `relax-hpc serve-engine` printed")

    def _once(self, method: str, url: str, data: bytes | None) -> Any:
        headers = {"Content-Type": "application/json"} if data is not None else {}
        reply = thread_client(self.timeout_s, self._token).request(method, url, content=data, headers=headers)
        if not 200 <= reply.status_code < 300:
            raise _Reply(reply)
        raw = reply.content
        return json.loads(raw.decode("utf-8")) if raw.strip() else {}


def _error_message(reply: httpx.Response) -> str:
    """The server's own message from a JSON error body, else the HTTP reason."""
    try:
        body = json.loads(reply.content.decode("utf-8"))
    except ValueError:
        return reply.reason_phrase
    if isinstance(body, dict):
        inner = body.get("error", body)
        message = inner.get("message") if isinstance(inner, dict) else inner
        if message:
            return str(message)[:500]
    return reply.reason_phrase
