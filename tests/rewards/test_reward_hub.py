"""The tiny task's reward and the reward hub (resolving `[reward] function`, scoring samples)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from pathlib import Path

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.registry import resolve_reward, score_samples
from relax_hpc.rewards.tiny import tiny_sum_reward


def _sample(text: str = "", finish: str = "length", label: str = "7") -> Sample:
    return Sample([4], [5], [-1.0], 0, group_id=0, prompt_index=0, label=label,
                  response_text=text, finish_reason=finish)


@pytest.mark.parametrize(
    ("text", "finish", "score", "exact"),
    [
        ("7", "stop", 1.0, 1.0),  # digit and end of turn: both target tokens right
        ("7", "length", 0.5, 0.0),  # right digit, did not stop: 1 of 2
        ("8", "stop", 0.0, 0.0),  # wrong first token
        ("", "stop", 0.0, 0.0),  # stopped at once
        ("", "length", 0.0, 0.0),
        ("<|im_start|>7", "stop", 0.0, 0.0),  # a special token before the digit
        ("77", "stop", 0.5, 0.0),  # right digit, then a second one instead of stopping
        ("7 ", "length", 0.5, 0.0),
    ],
)
def test_tiny_sum_reward(text: str, finish: str, score: float, exact: float) -> None:
    assert tiny_sum_reward(_sample(text, finish)) == {"score": score, "exact": exact}


def test_tiny_sum_reward_integer_label() -> None:
    assert tiny_sum_reward(_sample("4", "stop", label=4))["score"] == 1.0  # type: ignore[arg-type]


def test_resolve_builtin() -> None:
    assert resolve_reward("tiny_sum") is tiny_sum_reward
    assert resolve_reward("relax_hpc.rewards.tiny:tiny_sum_reward") is tiny_sum_reward


def _write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_resolve_module_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_module(tmp_path, monkeypatch, "my_reward_mod", """
        def length_reward(sample):
            return len(sample.response_text)
    """)
    fn = resolve_reward("my_reward_mod:length_reward")
    assert fn(_sample("abc")) == 3


def test_resolve_errors_say_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"'nope' is neither a built-in reward \(dapo, deepscaler, f1, .*tiny_sum\) nor"):
        resolve_reward("nope")
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_reward_mod'.*PYTHONPATH"):
        resolve_reward("no_such_reward_mod:fn")
    _write_module(tmp_path, monkeypatch, "my_reward_mod2", "VALUE = 1\n")
    with pytest.raises(ValueError, match=r"module 'my_reward_mod2' has no function 'missing'"):
        resolve_reward("my_reward_mod2:missing")
    with pytest.raises(ValueError, match=r"module 'my_reward_mod2' has no function 'VALUE'"):
        resolve_reward("my_reward_mod2:VALUE")  # present but not callable


def test_score_samples_sync() -> None:
    samples = [_sample("7", "stop"), _sample("7"), _sample("3", "stop")]
    score_samples(tiny_sum_reward, samples)
    assert [s.reward for s in samples] == [1.0, 0.5, 0.0]
    assert [s.raw_reward for s in samples] == [1.0, 0.5, 0.0]
    assert samples[0].reward_info == {"score": 1.0, "exact": 1.0}


def test_score_samples_plain_numbers() -> None:
    samples = [_sample("a"), _sample("bb")]
    score_samples(lambda s: len(s.response_text) == 2, samples)
    assert [s.reward for s in samples] == [0.0, 1.0]
    assert samples[1].reward_info == {}


def test_score_samples_async_runs_concurrently() -> None:
    active = 0
    peak = 0

    async def slow_reward(sample: Sample) -> dict[str, object]:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.2)
        active -= 1
        return {"score": len(sample.response_text), "note": "not a number, not logged"}

    samples = [_sample("x" * i) for i in range(5)]
    start = time.monotonic()
    score_samples(slow_reward, samples)
    elapsed = time.monotonic() - start
    assert peak == 5  # all five were in flight at once
    assert elapsed < 0.8  # five sequential calls would take 1.0 s
    assert [s.reward for s in samples] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert samples[2].reward_info == {"score": 2.0}


def test_dict_without_score_is_an_error() -> None:
    def bad_reward(sample: Sample) -> dict[str, float]:
        return {"accuracy": 1.0}

    with pytest.raises(ValueError, match="bad_reward returned a dict without a 'score' key"):
        score_samples(bad_reward, [_sample()])
