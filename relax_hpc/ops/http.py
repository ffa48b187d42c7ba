"""How relax-hpc's clients speak HTTP: httpx, one retry policy, and the token sent only where asked.

Every client of ours (the engine client `HttpEngine`, the remote reward model, the SGLang server's
health probe, the job's REST client) builds its connection with :func:`http_client`: no redirects
followed (one would carry the bearer token to another address) and no `HTTP(S)_PROXY` from the
environment (a login node's proxy would see the token, and cluster addresses are direct).

What a failed request costs is one :class:`RetryPolicy`: the waits between attempts double from
`backoff_s` up to `max_backoff_s`, and a reply is worth another attempt when :func:`retryable`
says so (429 and 5xx: the server is busy or broken; other 4xx mean the request is wrong).

    policy = RetryPolicy(retries=3, backoff_s=0.5)
    with http_client(timeout_s=30.0, token=token) as client:
        reply = client.post(url, json=body)
    if retryable(reply.status_code): time.sleep(policy.wait_s(0))
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Mapping

import httpx

__all__ = ["MAX_RETRY_AFTER_S", "TRANSPORT_ERRORS", "RetryPolicy", "async_http_client", "http_client",
           "retry_after_s", "retryable", "thread_client"]

MAX_RETRY_AFTER_S = 60.0  # a longer Retry-After is read as this
# A server that did not answer: refused, reset, timed out, or closed mid-reply (a grow job's engine
# cancelled while it sent one). Each is a failed attempt, like a 5xx.
TRANSPORT_ERRORS = (httpx.TransportError,)


@dataclass(frozen=True)
class RetryPolicy:
    """`retries` more attempts after the first, waiting `backoff_s`, twice that, ... at most
    `max_backoff_s` before each."""

    retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"a retry policy needs retries, backoff_s and max_backoff_s >= 0, got "
                             f"{self.retries}, {self.backoff_s} and {self.max_backoff_s}")

    @property
    def attempts(self) -> int:
        return self.retries + 1

    def wait_s(self, retry: int) -> float:
        """The wait before retry number `retry` (0: the first retry)."""
        return min(self.backoff_s * 2**retry, self.max_backoff_s)

    def total_wait_s(self) -> float:
        """Every wait of a request that fails all its attempts."""
        return sum(self.wait_s(i) for i in range(self.retries))


def retryable(status: int) -> bool:
    """A reply worth another attempt: 429 (too many requests) or a server error."""
    return status == 429 or status >= 500


def retry_after_s(headers: Mapping[str, str] | None) -> float | None:
    """The seconds of a reply's `Retry-After` when it is a number of seconds (not a date), capped."""
    value = (headers.get("Retry-After") or "").strip() if headers is not None else ""
    return min(float(value), MAX_RETRY_AFTER_S) if value.isascii() and value.isdigit() else None


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token is not None else {}


def http_client(timeout_s: float, token: str | None = None, keep_alive: bool = True) -> httpx.Client:
    """A client that sends `token` (if any) as a bearer token, follows no redirect and reads no
    proxy from the environment. One per thread: the engine client keeps one in each of its threads.
    Without `keep_alive` every request opens its own connection: a server restarted on the same
    port, or one closing an idle connection just as it is reused, then costs no failed attempt."""
    limits = httpx.Limits() if keep_alive else httpx.Limits(max_keepalive_connections=0)
    return httpx.Client(timeout=timeout_s, follow_redirects=False, trust_env=False, headers=_headers(token),
                        limits=limits)


_THREAD = threading.local()


def thread_client(timeout_s: float, token: str | None = None, keep_alive: bool = False) -> httpx.Client:
    """This thread's :func:`http_client` of these settings, made on first use (making one reads the
    CA bundle: tens of milliseconds, too much for every request). Nothing to pickle or close: an
    object that holds settings, not a client, travels to another process and asks there."""
    clients: dict[tuple[float, str | None, bool], httpx.Client] = _THREAD.__dict__.setdefault("clients", {})
    key = (timeout_s, token, keep_alive)
    if key not in clients:
        clients[key] = http_client(timeout_s, token, keep_alive)
    return clients[key]


def async_http_client(timeout_s: float, token: str | None = None) -> httpx.AsyncClient:
    """The asyncio form of :func:`http_client` (the agent proxy's callers)."""
    return httpx.AsyncClient(timeout=timeout_s, follow_redirects=False, trust_env=False, headers=_headers(token))
