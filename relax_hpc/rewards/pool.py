"""Concurrent reward scoring: async rewards on an event loop, plain ones in killable workers.

Where each reward runs:
- `@inline_reward` functions (cheap, cost bounded by the input length) in the scoring thread,
  one sample after the other, with the same error handling but no timeout;
- `async def` rewards (remote reward models, GenRM judges) on an event loop;
- other plain functions in worker processes (relax_hpc.rewards.workers): a sample that takes
  longer than `timeout_s` has its worker killed and replaced, and the step goes on. A plain
  reward that cannot be sent to a process (a closure, a lambda) runs on a thread instead, as
  do all plain rewards with `worker_processes = 0`; a thread cannot be killed, so a reward that
  hangs there keeps its thread.

`RewardPool.score` runs up to `concurrency` rewards at once and never raises for a reward's own
failure: a reward that raises, times out or returns something unusable scores what that reward
pays a wrong answer (`registry.failure_score`, 0 unless the reward declares otherwise: never
more than being wrong), and is counted in the sample's `reward_info` (`reward_error` /
`reward_timeout`) and in the returned stats (`reward/errors`, `reward/timeouts`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.registry import RewardFn, RewardResult, failure_score, is_inline_reward
from relax_hpc.rewards.workers import RewardWorkers, can_run_in_worker

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
    """Scores samples concurrently; reusable across steps. Call `close()` when done.

    `worker_processes`: processes for plain rewards (None: one per CPU this process may use, at
    most `concurrency`; 0: plain rewards run on threads). `worker_memory_mb`: each worker's
    address-space cap (0: none).
    """

    def __init__(
        self,
        concurrency: int = 16,
        timeout_s: float = 60.0,
        worker_processes: int | None = None,
        worker_memory_mb: int = 0,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"[reward] concurrency = {concurrency}: must be >= 1")
        if not timeout_s > 0:
            raise ValueError(f"[reward] timeout_s = {timeout_s}: must be > 0")
        if worker_processes is not None and worker_processes < 0:
            raise ValueError(f"[reward] worker_processes = {worker_processes}: must be >= 0")
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self._threads = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reward")
        if worker_processes is None:
            worker_processes = min(concurrency, _usable_cpus())
        self.workers = RewardWorkers(worker_processes, worker_memory_mb) if worker_processes > 0 else None
        self._sendable: dict[int, tuple[RewardFn, bool]] = {}  # id(fn) -> (fn, can go to a worker)

    def close(self) -> None:
        # Do not wait for rewards hung on threads: they end on their own or with the process.
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self.workers is not None:
            self.workers.close()

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
            name, fn = "?", None
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
                score, info = failure_score(fn), {"reward_error": 1.0}
            _set_score(sample, score, info, stats)
        return pooled

    async def _score_pooled(self, pooled: list[tuple[Sample, str, RewardFn]], stats: RewardStats) -> None:
        limit = asyncio.Semaphore(self.concurrency)
        await asyncio.gather(*(self._score_one(s, name, fn, limit, stats) for s, name, fn in pooled))

    def _report(self, stats: RewardStats, count: int) -> RewardStats:
        if stats.errors or stats.timeouts:
            log.warning(
                "%d reward errors and %d timeouts among %d samples (scored as wrong answers); first ones: %s",
                stats.errors, stats.timeouts, count, " | ".join(stats.messages),
            )
        return stats

    def _runs_in_worker(self, fn: RewardFn) -> bool:
        if self.workers is None:
            return False
        known = self._sendable.get(id(fn))
        if known is None or known[0] is not fn:
            known = (fn, can_run_in_worker(fn))
            self._sendable[id(fn)] = known
            if not known[1]:
                log.warning("reward %r cannot be sent to a worker process (it does not pickle); it runs on "
                            "a thread, where a timeout cannot stop it", getattr(fn, "__qualname__", fn))
        return known[1]

    async def _call(self, fn: RewardFn, sample: Sample) -> RewardResult:
        if is_async_reward(fn):
            return await asyncio.wait_for(fn(sample), self.timeout_s)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        if self._runs_in_worker(fn):
            # The worker enforces timeout_s from the moment it starts this sample (not while the
            # sample waits for a free worker), and kills itself past it.
            assert self.workers is not None
            return await loop.run_in_executor(self._threads, self.workers.run, fn, sample, self.timeout_s)
        result = await asyncio.wait_for(loop.run_in_executor(self._threads, fn, sample), self.timeout_s)
        if inspect.isawaitable(result):  # a plain function that returned a coroutine
            result = await asyncio.wait_for(result, self.timeout_s)
        return result  # type: ignore[return-value]

    async def _score_one(
        self, sample: Sample, name: str, fn: RewardFn, limit: asyncio.Semaphore, stats: RewardStats
    ) -> None:
        async with limit:
            try:
                stats.by_type[name] = stats.by_type.get(name, 0) + 1
                score, info = to_score(await self._call(fn, sample), name)
            except (asyncio.TimeoutError, TimeoutError):
                stats.timeouts += 1
                stats.note(f"reward {name} took longer than timeout_s={self.timeout_s}")
                score, info = failure_score(fn), {"reward_timeout": 1.0}
            except Exception as e:  # a reward's failure must not end rollout; it is counted instead
                stats.errors += 1
                stats.note(f"reward {name}: {type(e).__name__}: {e}")
                score, info = failure_score(fn), {"reward_error": 1.0}
        _set_score(sample, score, info, stats)


def _usable_cpus() -> int:
    """CPUs this process may run on (a Slurm step's allocation), not the whole node's."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def _set_score(sample: Sample, score: float, info: dict[str, float], stats: RewardStats) -> None:
    sample.raw_reward = sample.reward = score
    sample.reward_info = info
    stats.scored += 1
