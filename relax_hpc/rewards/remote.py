"""`remote_rm`: a reward model behind an HTTP endpoint (POST JSON, read a float back).

Request body: {"prompt", "response", "label", "metadata"} (metadata values that are not JSON,
e.g. image bytes, are sent as a short description). Accepted replies: a bare number, or an
object with "score" or "reward" (other numeric keys are logged as reward details).
Connection errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff; other 4xx
replies are the caller's mistake and fail at once (relax_hpc/ops/http.py: the client and the
retry policy every HTTP client of ours shares). Every error names the URL.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any

from relax_hpc.data.sample import Sample
from relax_hpc.ops.http import TRANSPORT_ERRORS, RetryPolicy, retryable, thread_client


class RemoteRewardError(RuntimeError):
    pass


class _Reply(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(code)
        self.code, self.reason = code, reason


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    return repr(value)


def parse_reward_reply(body: Any, url: str) -> dict[str, float]:
    """Turn a decoded JSON reply into {"score": ..., details...}; raises naming the URL."""
    if isinstance(body, bool) or not isinstance(body, (int, float, dict)):
        raise RemoteRewardError(f"reward model at {url} replied {body!r}; expected a number or {{\"score\": number}}")
    if isinstance(body, dict):
        key = "score" if "score" in body else "reward" if "reward" in body else None
        if key is None or isinstance(body[key], bool) or not isinstance(body[key], (int, float)):
            raise RemoteRewardError(
                f"reward model at {url} replied {json.dumps(body)[:200]}; expected a numeric 'score' or 'reward' key"
            )
        info = {k: float(v) for k, v in body.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        info["score"] = float(body[key])
        info.pop("reward", None)
        return info
    return {"score": float(body)}


@dataclass
class RemoteRewardModel:
    """An async reward function that asks an HTTP reward model."""

    url: str
    timeout_s: float = 30.0
    max_retries: int = 3  # retries after the first attempt
    backoff_s: float = 0.5  # first wait; doubles per retry
    max_backoff_s: float = 10.0

    @property
    def policy(self) -> RetryPolicy:
        return RetryPolicy(self.max_retries, self.backoff_s, self.max_backoff_s)

    def _post_once(self, payload: bytes) -> Any:
        client = thread_client(self.timeout_s)  # this thread's: the model travels to reward workers
        reply = client.post(self.url, content=payload, headers={"Content-Type": "application/json"})
        if not 200 <= reply.status_code < 300:
            raise _Reply(reply.status_code, reply.reason_phrase)
        return json.loads(reply.content.decode("utf-8"))

    def payload(self, sample: Sample) -> bytes:
        body = {
            "prompt": sample.prompt_text,
            "response": sample.response_text,
            "label": sample.label,
            "metadata": sample.metadata,
        }
        return json.dumps(body, default=_jsonable).encode("utf-8")

    async def __call__(self, sample: Sample) -> dict[str, float]:
        payload = self.payload(sample)
        attempts = self.policy.attempts
        last = ""
        for attempt in range(attempts):
            try:
                body = await asyncio.to_thread(self._post_once, payload)
                score = parse_reward_reply(body, self.url)
                if not math.isfinite(score["score"]):
                    raise RemoteRewardError(f"reward model at {self.url} replied a non-finite score")
                return score
            except _Reply as e:
                last = f"HTTP {e.code} {e.reason}"
                if not retryable(e.code):
                    raise RemoteRewardError(
                        f"reward model at {self.url} rejected the request: {last}; check [reward] remote_url "
                        "and what the server expects"
                    ) from None
            except TRANSPORT_ERRORS as e:
                last = f"{type(e).__name__}: {e or 'no detail'}"
            except json.JSONDecodeError as e:
                last = f"reply is not JSON ({e.msg})"
            if attempt + 1 < attempts:
                await asyncio.sleep(self.policy.wait_s(attempt))
        raise RemoteRewardError(
            f"reward model at {self.url} failed after {attempts} attempts (last error: {last}); "
            f"is the server up? [reward] remote_url = {self.url!r}, timeout_s = {self.timeout_s}"
        )
