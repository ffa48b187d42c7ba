"""The reward worker pool and the hub: concurrency, timeouts, errors, per-sample reward choice."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.hub import RewardHub
from relax_hpc.rewards.pool import RewardPool
from relax_hpc.rewards.registry import BUILTIN_REWARDS, inline_reward, is_inline_reward, resolve_reward


def _sample(text: str = "", label: object = None, **metadata: object) -> Sample:
    return Sample([1], [2], [-1.0], 0, group_id=0, prompt_index=0, label=label, response_text=text,
                  metadata=dict(metadata))


def test_sync_rewards_run_on_threads_concurrently() -> None:
    active, peak, lock = 0, 0, threading.Lock()

    def slow(sample: Sample) -> float:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.2)
        with lock:
            active -= 1
        return len(sample.response_text)

    samples = [_sample("x" * i) for i in range(6)]
    with RewardPool(concurrency=3, timeout_s=5) as pool:
        stats = pool.score(samples, lambda s: ("slow", slow))
    assert peak == 3  # the limit holds, and three really ran at once
    assert [s.reward for s in samples] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert stats.as_metrics() == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/count/slow": 6.0}


def test_failures_and_timeouts_score_zero_and_are_counted() -> None:
    async def hangs(sample: Sample) -> float:
        await asyncio.sleep(30)
        return 1.0

    def raises(sample: Sample) -> float:
        raise RuntimeError("judge crashed")

    pick = {"hang": ("hangs", hangs), "boom": ("raises", raises), "nan": ("nan", lambda s: float("nan")),
            "nodict": ("nodict", lambda s: {"acc": 1.0}), "ok": ("ok", lambda s: {"score": 0.5, "acc": 1})}
    samples = [_sample(k) for k in pick]
    with RewardPool(concurrency=8, timeout_s=0.3) as pool:
        stats = pool.score(samples, lambda s: pick[s.response_text])
    assert [s.reward for s in samples] == [0.0, 0.0, 0.0, 0.0, 0.5]
    assert samples[0].reward_info == {"reward_timeout": 1.0}
    assert samples[1].reward_info == {"reward_error": 1.0}
    assert samples[4].reward_info == {"score": 0.5, "acc": 1.0}
    assert (stats.errors, stats.timeouts) == (3, 1)
    assert "reward hangs took longer than timeout_s=0.3" in stats.messages
    assert "reward raises: RuntimeError: judge crashed" in stats.messages
    assert any("returned a non-finite score nan" in m for m in stats.messages)
    assert any("without a 'score' key (keys: ['acc'])" in m for m in stats.messages)


def test_inline_rewards_run_in_the_calling_thread_beside_pooled_ones() -> None:
    caller, threads = threading.get_ident(), {}

    @inline_reward
    def cheap(sample: Sample) -> float:
        threads.setdefault("cheap", set()).add(threading.get_ident())
        return 1.0

    def pooled(sample: Sample) -> float:
        threads.setdefault("pooled", set()).add(threading.get_ident())
        return 2.0

    @inline_reward
    def broken(sample: Sample) -> float:
        raise ValueError("bad label")

    def pick(sample: Sample) -> tuple[str, object]:
        if sample.response_text == "?":
            raise KeyError("no reward named 'nope'")
        return {"c": ("cheap", cheap), "p": ("pooled", pooled), "b": ("broken", broken)}[sample.response_text]

    samples = [_sample(t) for t in "cpcbp?"]
    with RewardPool(concurrency=2, timeout_s=5) as pool:
        stats = pool.score(samples, pick)
    assert [s.reward for s in samples] == [1.0, 2.0, 1.0, 0.0, 2.0, 0.0]
    assert threads["cheap"] == {caller} and caller not in threads["pooled"]
    assert stats.by_type == {"cheap": 2, "pooled": 2, "broken": 1} and stats.scored == 6
    assert stats.errors == 2 and samples[3].reward_info == {"reward_error": 1.0}
    assert "reward broken: ValueError: bad label" in stats.messages
    assert "reward ?: KeyError: \"no reward named 'nope'\"" in stats.messages


def test_inline_marks_only_plain_functions_and_the_cheap_built_ins_carry_it() -> None:
    async def judge(sample: Sample) -> float:
        return 1.0

    with pytest.raises(TypeError, match="judge is async def"):
        inline_reward(judge)
    marked = {name for name in BUILTIN_REWARDS if is_inline_reward(resolve_reward(name))}
    # string matching only; the math rewards call a symbolic checker, the others parse instructions
    assert marked == {"tiny_sum", "multiple_choice", "gpqa", "f1"}


def test_pool_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"\[reward\] concurrency = 0: must be >= 1"):
        RewardPool(concurrency=0)
    with pytest.raises(ValueError, match=r"\[reward\] timeout_s = 0: must be > 0"):
        RewardPool(timeout_s=0)


def test_hub_picks_reward_from_metadata() -> None:
    samples = [
        _sample(r"\boxed{2}", "2"),  # default: math
        _sample("wrong\nAnswer: 3", "2", rm_type="dapo"),
        _sample("<answer>B</answer>", "B", rm_type="multiple_choice"),
        _sample("Answer: 2", "2", rm_type="math_dapo"),  # a data_source alias
        _sample("x", "2", rm_type="no_such_reward"),
    ]
    hub = RewardHub("math", type_key="rm_type", concurrency=4, timeout_s=10)
    try:
        metrics = hub.score(samples)
    finally:
        hub.close()
    assert [s.reward for s in samples] == [1.0, -1.0, 1.0, 1.0, 0.0]
    assert samples[4].reward_info == {"reward_error": 1.0}
    assert metrics["reward/count/math"] == 1.0 and metrics["reward/count/dapo"] == 2.0
    assert metrics["reward/errors"] == 1.0
    with pytest.raises(ValueError, match="metadata rm_type='no_such_reward' names no reward; use one of"):
        hub.pick(samples[4])


def test_hub_custom_async_reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_async_rm.py").write_text(textwrap.dedent("""
        import asyncio

        async def judge(sample):
            await asyncio.sleep(0.01)
            return {"score": float(sample.response_text == sample.label), "len": len(sample.response_text)}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_async_rm", raising=False)
    hub = RewardHub("my_async_rm:judge")
    samples = [_sample("yes", "yes"), _sample("no", "yes")]
    hub.score(samples)
    hub.close()
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert samples[0].reward_info == {"score": 1.0, "len": 3.0}


def test_hub_configured_rewards_say_what_is_missing() -> None:
    with pytest.raises(ValueError, match=r'"remote_rm" needs \[reward\] remote_url'):
        RewardHub("remote_rm")
    with pytest.raises(ValueError, match='"genrm" needs a judge engine'):
        RewardHub("genrm")
    with pytest.raises(ValueError, match="neither a built-in reward"):
        RewardHub("not_a_reward")


def test_hub_from_spec_settings() -> None:
    from relax_hpc.spec.schema import RewardSpec

    spec = RewardSpec(function="f1", type_key="data_source", concurrency=2, timeout_s=5.0)
    hub = RewardHub.from_settings(spec)
    assert (hub.pool.concurrency, hub.pool.timeout_s, hub.type_key) == (2, 5.0, "data_source")
    hub.close()
