"""The tiny task's reward and the reward hub (resolving `[reward] function`, scoring samples)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.registry import resolve_reward
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


