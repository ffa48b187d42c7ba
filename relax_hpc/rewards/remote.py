"""`remote_rm`: a reward model behind an HTTP endpoint (POST JSON, read a float back).

Request body: {"prompt", "response", "label", "metadata"} (metadata values that are not JSON,
e.g. image bytes, are sent as a short description). Accepted replies: a bare number, or an
object with "score" or "reward" (other numeric keys are logged as reward details).
Connection errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff; other 4xx
replies are the caller's mistake and fail at once. Every error names the URL.
"""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from relax_hpc.data.sample import Sample


class RemoteRewardError(RuntimeError):
    pass


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

    def backoff_s_before(self, retry: int) -> float:
        return min(self.backoff_s * 2**retry, self.max_backoff_s)

    def total_backoff_s(self) -> float:
        return sum(self.backoff_s_before(i) for i in range(self.max_retries))

    def _post_once(self, payload: bytes) -> Any:
        request = urllib.request.Request(
            self.url, data=payload, method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
            return json.loads(reply.read().decode("utf-8"))

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
        attempts = self.max_retries + 1
        last = ""
        for attempt in range(attempts):
            try:
                body = await asyncio.to_thread(self._post_once, payload)
                score = parse_reward_reply(body, self.url)
                if not math.isfinite(score["score"]):
                    raise RemoteRewardError(f"reward model at {self.url} replied a non-finite score")
                return score
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} {e.reason}"
                if e.code != 429 and e.code < 500:
                    raise RemoteRewardError(
                        f"reward model at {self.url} rejected the request: {last}; check [reward] remote_url "
                        "and what the server expects"
                    ) from e
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                reason = getattr(e, "reason", e)
                last = f"{type(reason).__name__}: {reason}"
            except json.JSONDecodeError as e:
                last = f"reply is not JSON ({e.msg})"
            if attempt + 1 < attempts:
                await asyncio.sleep(self.backoff_s_before(attempt))
        raise RemoteRewardError(
            f"reward model at {self.url} failed after {attempts} attempts (last error: {last}); "
            f"is the server up? [reward] remote_url = {self.url!r}, timeout_s = {self.timeout_s}"
        )
