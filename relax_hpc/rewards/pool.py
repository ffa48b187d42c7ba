"""Concurrent reward scoring: async rewards on an event loop, sync ones on a thread pool.

Rewards marked `@inline_reward` (cheap, never blocking) skip both: they are called in the
scoring thread, one sample after the other, with the same error handling but no timeout.

Why: a GenRM judge or a remote reward model takes seconds per sample; scored one after the
other they would stall rollout. `RewardPool.score` runs up to `concurrency` rewards at once,
bounds each by `timeout_s`, and never raises for a reward's own failure: a reward that raises,
times out or returns something unusable scores 0 and is counted in the sample's `reward_info`
(`reward_error` / `reward_timeout`) and in the returned stats.

A timed-out synchronous reward keeps its worker thread until it returns (Python cannot kill a
thread); the pool has `concurrency` threads, so a reward that hangs forever shrinks the pool.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.registry import RewardFn, RewardResult, is_inline_reward

log = logging.getLogger(__name__)

# Errors quoted in the log per batch; the rest are only counted.
MAX_MESSAGES = 5

# Reward picked per sample: (name used in messages and stats, callable).
Picker = Callable[[Sample], tuple[str, RewardFn]]


def is_async_reward(fn: Any) -> bool:
    """True for `async def` functions and objects whose `__call__` is `async def`."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def to_score(value: RewardResult, name: str) -> tuple[float, dict[str, float]]:
    """(score, numeric details) of a reward's return value; ValueError when unusable."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward {name} returned a dict without a 'score' key (keys: {sorted(value)})")
        info = {k: float(v) for k, v in value.items() if isinstance(v, (int, float, bool))}
        score = value["score"]
    else:
        info, score = {}, value
    if not isinstance(score, (int, float, bool)):
        raise ValueError(f"reward {name} returned score {score!r}; expected a number")
    if not math.isfinite(float(score)):
        raise ValueError(f"reward {name} returned a non-finite score {score!r}")
    return float(score), info


@dataclass
class RewardStats:
    """What one `score` call saw, as metrics."""

    scored: int = 0
    errors: int = 0
    timeouts: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)  # the first MAX_MESSAGES errors, for the log

    def note(self, message: str) -> None:
        if len(self.messages) < MAX_MESSAGES:
            self.messages.append(message)

    def as_metrics(self) -> dict[str, float]:
        out = {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts)}
        for name, count in sorted(self.by_type.items()):
            out[f"reward/count/{name}"] = float(count)
        return out


class RewardPool:
    """Scores samples concurrently; reusable across steps. Call `close()` when done."""

    def __init__(self, concurrency: int = 16, timeout_s: float = 60.0) -> None:
        if concurrency < 1:
            raise ValueError(f"[reward] concurrency = {concurrency}: must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"[reward] timeout_s = {timeout_s}: must be > 0")
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self._threads = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reward")

    def close(self) -> None:
        # Do not wait for hung rewards: their threads end on their own or with the process.
        self._threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(self, samples: list[Sample], pick: Picker) -> RewardStats:
        """Score every sample in place (reward, raw_reward, reward_info). Blocks until done."""
        stats = RewardStats()
        pooled = self._score_inline(samples, pick, stats)
        if pooled:
            asyncio.run(self._score_pooled(pooled, stats))
        return self._report(stats, len(samples))

    async def score_async(self, samples: list[Sample], pick: Picker) -> RewardStats:
        stats = RewardStats()
        pooled = self._score_inline(samples, pick, stats)
        if pooled:
            await self._score_pooled(pooled, stats)
        return self._report(stats, len(samples))

    def _score_inline(
        self, samples: list[Sample], pick: Picker, stats: RewardStats
    ) -> list[tuple[Sample, str, RewardFn]]:
        """Score the samples whose reward is inline (or cannot be picked); returns the others
        with the reward `pick` chose for them."""
        pooled: list[tuple[Sample, str, RewardFn]] = []
        for sample in samples:
            name = "?"
            try:
                name, fn = pick(sample)
                if not is_inline_reward(fn):
                    pooled.append((sample, name, fn))
                    continue
                stats.by_type[name] = stats.by_type.get(name, 0) + 1
                score, info = to_score(fn(sample), name)  # type: ignore[arg-type]
            except Exception as e:  # a reward's failure must not end rollout; it is counted instead
                stats.errors += 1
                stats.note(f"reward {name}: {type(e).__name__}: {e}")
                score, info = 0.0, {"reward_error": 1.0}
            _set_score(sample, score, info, stats)
        return pooled

    async def _score_pooled(self, pooled: list[tuple[Sample, str, RewardFn]], stats: RewardStats) -> None:
        limit = asyncio.Semaphore(self.concurrency)
        await asyncio.gather(*(self._score_one(s, name, fn, limit, stats) for s, name, fn in pooled))

    def _report(self, stats: RewardStats, count: int) -> RewardStats:
        if stats.errors or stats.timeouts:
            log.warning(
                "%d reward errors and %d timeouts among %d samples (scored 0); first ones: %s",
                stats.errors, stats.timeouts, count, " | ".join(stats.messages),
            )
        return stats

    async def _call(self, fn: RewardFn, sample: Sample) -> RewardResult:
        if is_async_reward(fn):
            return await fn(sample)  # type: ignore[misc]
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._threads, fn, sample)
        if inspect.isawaitable(result):  # a plain function that returned a coroutine
            result = await result
        return result  # type: ignore[return-value]

    async def _score_one(
        self, sample: Sample, name: str, fn: RewardFn, limit: asyncio.Semaphore, stats: RewardStats
    ) -> None:
        async with limit:
            try:
                stats.by_type[name] = stats.by_type.get(name, 0) + 1
                value = await asyncio.wait_for(self._call(fn, sample), self.timeout_s)
                score, info = to_score(value, name)
            except asyncio.TimeoutError:
                stats.timeouts += 1
                stats.note(f"reward {name} took longer than timeout_s={self.timeout_s}")
                score, info = 0.0, {"reward_timeout": 1.0}
            except Exception as e:  # a reward's failure must not end rollout; it is counted instead
                stats.errors += 1
                stats.note(f"reward {name}: {type(e).__name__}: {e}")
                score, info = 0.0, {"reward_error": 1.0}
        _set_score(sample, score, info, stats)


def _set_score(sample: Sample, score: float, info: dict[str, float], stats: RewardStats) -> None:
    sample.raw_reward = sample.reward = score
    sample.reward_info = info
    stats.scored += 1
