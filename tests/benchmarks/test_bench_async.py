"""benchmarks/bench_async.py: the reward of the last steps and the summary line, from figures
chosen by hand. No training run, no timing."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest
from bench_scripts import benchmark_module


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with benchmark_module("bench_async") as module:
        yield module


def test_final_reward_is_the_mean_of_the_last_20_steps(bench: ModuleType) -> None:
    rewards = [0.0] * 30 + [0.5] * 10 + [1.0] * 10  # the last 20: ten 0.5 and ten 1.0
    assert bench.final_reward(rewards) == pytest.approx(0.75)
    assert bench.final_reward([0.2, 0.4]) == pytest.approx(0.3)  # fewer steps than 20: all of them


def test_one_pair(bench: ModuleType) -> None:
    # speed-up 21.1 / 12.6 = 1.6746; gap 0.92 - 0.90 = 0.02
    line = bench.summary_line([((12.6, 0.92), (21.1, 0.90))])
    assert line == ("async speedup 1.67x (colocate 12.6 steps/s, async 21.1 steps/s); "
                    "reward gap: 0.02 (colocate 0.92, async 0.90, mean of the last 20 steps)")


def test_three_pairs_report_medians_then_each_pair(bench: ModuleType) -> None:
    pairs = [
        ((10.0, 0.90), (17.0, 0.89)),  # 1.70x, gap 0.01
        ((12.0, 0.92), (18.0, 0.88)),  # 1.50x, gap 0.04
        ((11.0, 0.80), (17.6, 0.82)),  # 1.60x, gap -0.02: async ahead
    ]
    line = bench.summary_line(pairs)
    # medians: ratio 1.60, gap 0.01; colocate 11.0 steps/s and 0.90; async 17.6 steps/s and 0.88
    assert line == ("async speedup 1.60x (colocate 11.0 steps/s, async 17.6 steps/s; pairs 1.70 1.50 1.60); "
                    "reward gap: 0.01 (colocate 0.90, async 0.88, mean of the last 20 steps; "
                    "pairs 0.01 0.04 -0.02)")


def test_no_pair_is_an_error(bench: ModuleType) -> None:
    with pytest.raises(ValueError):
        bench.summary_line([])


def test_spec_text_sets_the_seed_only_when_asked(bench: ModuleType, tmp_path: Path) -> None:
    base = '[job]\nname = "tiny_local"\nseed = 1\nmode = "colocate"\n\n[algorithm]\nmax_staleness = 0\n'
    kept = bench.spec_text(base, tmp_path / "model", tmp_path / "job", 300, "async", 1, 2.0)
    assert "\nseed = 1\n" in kept and 'mode = "async"' in kept
    assert "max_staleness = 1\ntis_cap = 2.0" in kept
    varied = bench.spec_text(base, tmp_path / "model", tmp_path / "job", 300, "async", 1, 2.0, seed=4)
    assert "\nseed = 4\n" in varied and "seed = 1" not in varied
