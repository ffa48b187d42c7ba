"""The reward hub: resolve `[reward] function` to a callable and score samples with it.

`function` is either a built-in name (see BUILTIN_REWARDS) or "package.module:function". A reward
function takes a `Sample` and returns a float or a dict with a "score" key (other keys are logged
as reward details); it may be `async def`. A plain function marked `@inline_reward` (quick, no
I/O, bounded work) is called in the scoring thread instead of the worker pool.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import Any, Awaitable, Callable, Union

from relax_hpc.data.sample import Sample

RewardResult = Union[float, int, bool, dict[str, Any]]
RewardFn = Callable[[Sample], Union[RewardResult, Awaitable[RewardResult]]]

INLINE_ATTR = "relax_inline_reward"


def inline_reward(fn: Callable[[Sample], RewardResult]) -> Callable[[Sample], RewardResult]:
    """Mark a plain reward function as cheap: scored in the caller's thread, not the pool.

    For functions that finish in well under a millisecond and never block (string matching,
    small arithmetic). Handing each sample to a worker thread costs tens of microseconds, more
    than such a function itself; on a small host it was most of rollout's scoring time. An
    inline reward is not bounded by `timeout_s` (a thread cannot be interrupted), so never mark
    one that does I/O, calls a solver, or runs a regex a response can make slow.
    """
    if inspect.iscoroutinefunction(fn):
        raise TypeError(f"inline_reward marks plain functions; {fn.__name__} is async def")
    setattr(fn, INLINE_ATTR, True)
    return fn


def is_inline_reward(fn: Any) -> bool:
    return bool(getattr(fn, INLINE_ATTR, False))


# name -> "module:function"; imported lazily so heavy reward dependencies load only when used.
BUILTIN_REWARDS: dict[str, str] = {
    "tiny_sum": "relax_hpc.rewards.tiny:tiny_sum_reward",
    "math": "relax_hpc.rewards.math_answer:math_reward",
    "dapo": "relax_hpc.rewards.math_answer:dapo_reward",
    "deepscaler": "relax_hpc.rewards.math_answer:deepscaler_reward",
    "multiple_choice": "relax_hpc.rewards.choice:multiple_choice_reward",
    "gpqa": "relax_hpc.rewards.choice:gpqa_reward",
    "f1": "relax_hpc.rewards.f1:f1_reward",
    "ifbench": "relax_hpc.rewards.ifbench:ifbench_reward",
    "openr1mm": "relax_hpc.rewards.openr1mm:openr1mm_reward",
}
# Rewards built from [reward] settings rather than imported (see relax_hpc.rewards.hub).
CONFIGURED_REWARDS: tuple[str, ...] = ("remote_rm", "genrm")


def resolve_reward(function: str) -> RewardFn:
    """Return the reward callable for a built-in name or a "module:function" path."""
    target = BUILTIN_REWARDS.get(function, function)
    if ":" not in target:
        raise ValueError(
            f"[reward] function = {function!r} is neither a built-in reward "
            f"({', '.join(sorted(BUILTIN_REWARDS))}) nor a 'package.module:function' path"
            + (" (it is configured: build it with relax_hpc.rewards.hub.RewardHub)" if function in CONFIGURED_REWARDS else "")
        )
    module_name, attr = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"[reward] function = {function!r}: cannot import module '{module_name}' ({e}); "
            "is it installed or on PYTHONPATH?"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"[reward] function = {function!r}: module '{module_name}' has no function '{attr}'")
    return fn


def _as_score(value: RewardResult, function_name: str) -> tuple[float, dict[str, float]]:
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward function {function_name} returned a dict without a 'score' key")
        info = {k: float(v) for k, v in value.items() if isinstance(v, (int, float, bool))}
        return float(value["score"]), info
    return float(value), {}


def score_samples(fn: RewardFn, samples: list[Sample]) -> None:
    """Score every sample in place (sets reward, raw_reward, reward_info); async functions run concurrently."""
    name = getattr(fn, "__qualname__", repr(fn))
    if inspect.iscoroutinefunction(fn):
        async def run_all() -> list[Any]:
            return await asyncio.gather(*(fn(s) for s in samples))

        results = asyncio.run(run_all())
    else:
        results = [fn(s) for s in samples]
    for sample, value in zip(samples, results):
        score, info = _as_score(value, name)
        sample.raw_reward = sample.reward = score
        sample.reward_info = info
