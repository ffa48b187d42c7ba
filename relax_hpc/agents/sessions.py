"""Agent sessions: one API key each, the completions made under it, and expiry.

The store lives in the proxy's event loop (no locks needed). A key is `key_prefix` (the proxy's
bearer token and a dot) and a random 32-byte part; only the key identifies a session, so no
request can name another session's data.

The keys of ended sessions are remembered so that a late request hears "session expired" rather
than "invalid API key"; only the last `max_expired_keys` (MAX_EXPIRED_KEYS) are, so a run that
opens millions of sessions keeps a bounded set. An older key is refused all the same, as invalid.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from relax_hpc.agents.export import CompletionRecord


MAX_EXPIRED_KEYS = 4096  # ended sessions whose keys get "session expired" rather than "invalid"


class SessionAuthError(Exception):
    """The request's key is missing, unknown or expired (HTTP 401)."""


@dataclass
class Session:
    session_id: str
    api_key: str
    expires_at: float
    completions: list[CompletionRecord] = field(default_factory=list)
    # The Responses API's: each response as served, and its conversation (input and output as chat
    # messages) for a later request's previous_response_id.
    responses: dict[str, dict[str, Any]] = field(default_factory=dict)
    conversations: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def find(self, completion_id: str) -> CompletionRecord | None:
        return next((c for c in self.completions if c.completion_id == completion_id), None)


class SessionStore:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic, key_prefix: str = "",
                 max_expired_keys: int = MAX_EXPIRED_KEYS) -> None:
        if ttl_s <= 0:
            raise ValueError(f"session ttl must be > 0 seconds, got {ttl_s}")
        if max_expired_keys < 0:
            raise ValueError(f"max_expired_keys must be >= 0, got {max_expired_keys}")
        self.ttl_s, self._clock, self._key_prefix = ttl_s, clock, key_prefix
        self._by_key: dict[str, Session] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()  # oldest first
        self._max_expired = max_expired_keys
        self._counter = 0

    def open(self) -> Session:
        self._counter += 1
        session = Session(f"s{self._counter}-{secrets.token_hex(4)}",
                          f"{self._key_prefix}sk-relax-{secrets.token_urlsafe(32)}",
                          self._clock() + self.ttl_s)
        self._by_key[session.api_key] = session
        return session

    def lookup(self, api_key: str | None) -> Session:
        """The live session of `api_key`; SessionAuthError with the reason otherwise."""
        if not api_key:
            raise SessionAuthError("missing API key: send 'Authorization: Bearer <key>' with the key of your session")
        session = self._by_key.get(api_key)
        if session is None:
            reason = "session expired" if api_key in self._expired else "invalid API key"
            raise SessionAuthError(f"{reason}: each agent session has its own key, valid while the session runs")
        if self._clock() >= session.expires_at:
            self._retire(session)
            raise SessionAuthError(f"session expired after {self.ttl_s:g} s ([rollout] agent_session_timeout_s)")
        return session

    def close(self, session: Session) -> list[CompletionRecord]:
        """End a session (its key stops working) and return its completions."""
        self._retire(session)
        return session.completions

    def _retire(self, session: Session) -> None:
        if self._by_key.pop(session.api_key, None) is not None and self._max_expired:
            self._expired[session.api_key] = None
            while len(self._expired) > self._max_expired:
                self._expired.popitem(last=False)

    def __len__(self) -> int:
        return len(self._by_key)
