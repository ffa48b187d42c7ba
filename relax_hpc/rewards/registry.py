"""The reward hub: resolve `[reward] function` to a callable and score samples with it.

`function` is either a built-in name (see BUILTIN_REWARDS) or "package.module:function". A reward
function takes a `Sample` and returns a float or a dict with a "score" key (other keys are logged
as reward details); it may be `async def`. A plain function marked `@inline_reward` (quick, no
I/O, bounded work) is called in the scoring thread instead of a worker process. A reward whose
wrong answers score other than 0 says so with `@scores_failure_as(score)`: timeouts and errors
are paid that.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Awaitable, Callable, TypeVar, Union

from relax_hpc.data.sample import Sample

RewardResult = Union[float, int, bool, dict[str, Any]]
RewardFn = Callable[[Sample], Union[RewardResult, Awaitable[RewardResult]]]

RewardFnT = TypeVar("RewardFnT")

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


FAILURE_SCORE_ATTR = "relax_failure_score"


def scores_failure_as(score: float) -> Callable[[RewardFnT], RewardFnT]:
    """Declare what a reward pays a wrong answer, so a failure to score is paid the same.

    A timeout, an error or an unparseable answer must never score above a wrong answer: a
    policy would learn to fail on purpose (under DAPO's 1 / -1 rule a timeout scoring 0 is a
    reward for emitting expressions that time out). Rewards without the mark are taken to pay
    0 for a wrong answer.
    """

    def mark(fn: RewardFnT) -> RewardFnT:
        setattr(fn, FAILURE_SCORE_ATTR, float(score))
        return fn

    return mark


def failure_score(fn: Any) -> float:
    """What `fn` pays a wrong answer (see scores_failure_as); 0.0 when it does not say."""
    return float(getattr(fn, FAILURE_SCORE_ATTR, 0.0))


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
