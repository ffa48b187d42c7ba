"""The progress reporter: a bar on a terminal, a plain line every N seconds of a fake clock otherwise."""

from __future__ import annotations

import io

import pytest

from relax_hpc.ops.progress import (
    EVERY_S_ENV,
    LineProgress,
    NoProgress,
    TqdmProgress,
    format_duration,
    make_progress,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 45, 59.6, 400, 3599, 7320)] == [
        "0s", "45s", "1m00s", "6m40s", "59m59s", "2h02m"]


def test_a_line_every_n_seconds_with_the_mean_step_time_and_eta() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = LineProgress(total=400, every_s=30, stream=out, clock=clock)
    for step in range(1, 26):  # 1.5 s a step: the first line once 30 s have passed (step 20)
        clock.now += 1.5
        progress.update(step, reward=0.01 * step, step_s=1.5)
    assert out.getvalue().splitlines() == [
        # 20 steps in 30 s -> 1.50 s/step; (400 - 20) * 1.5 = 570 s = 9m30s
        "step 20/400  reward 0.200  1.50 s/step  eta 9m30s",
    ]
    for step in range(26, 41):  # slower now: 2 s a step
        clock.now += 2.0
        progress.update(step, reward=0.513, step_s=2.0)
    # The second line: steps 21-25 took 7.5 s, so 30 s pass at step 37 (7.5 + 12 * 2 = 31.5 s);
    # 31.5 s / 17 steps = 1.853 s/step; (400 - 37) * 1.853 = 672.6 s -> 11m13s
    assert out.getvalue().splitlines()[1:] == ["step 37/400  reward 0.513  1.85 s/step  eta 11m13s"]
    clock.now += 0.5
    progress.close()
    assert out.getvalue().splitlines()[2:] == [
        # steps 38-40 in 3 * 2 + 0.5 = 6.5 s -> 2.17 s/step; 25 * 1.5 + 15 * 2 + 0.5 = 68 s since the start
        "step 40/400  reward 0.513  2.17 s/step  ran 1m08s",
    ]


def test_no_end_line_when_nothing_is_new_and_none_without_steps() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = LineProgress(total=5, every_s=0, stream=out, clock=clock)
    for step in (1, 2):
        clock.now += 0.5
        progress.update(step, reward=1.0, step_s=0.5)
    progress.close()
    assert out.getvalue().splitlines() == [
        "step 1/5  reward 1.000  0.50 s/step  eta 2s",  # 4 * 0.5
        "step 2/5  reward 1.000  0.50 s/step  eta 2s",  # 3 * 0.5 = 1.5, rounded to 2
    ]
    empty = io.StringIO()
    LineProgress(total=5, every_s=30, stream=empty, clock=clock).close()
    assert empty.getvalue() == ""


def test_a_resumed_run_counts_from_its_first_step() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = LineProgress(total=400, every_s=10, stream=out, clock=clock)
    for step in range(201, 206):  # resumed at step 200; 5 steps of 2 s
        clock.now += 2.0
        progress.update(step, reward=0.9, step_s=2.0)
    assert out.getvalue().splitlines() == ["step 205/400  reward 0.900  2.00 s/step  eta 6m30s"]  # 195 * 2


def test_a_terminal_gets_the_bar_and_a_log_the_lines() -> None:
    assert isinstance(make_progress(10, "x", stream=Terminal(), env={}), TqdmProgress)
    log = make_progress(10, "x", stream=io.StringIO(), env={EVERY_S_ENV: "5"})
    assert isinstance(log, LineProgress) and log.every_s == 5
    assert isinstance(make_progress(10, "x", stream=io.StringIO(), env={}), LineProgress)
    assert isinstance(make_progress(10, "x", enabled=False, stream=Terminal(), env={}), NoProgress)


def test_the_bar_shows_step_reward_and_seconds() -> None:
    out = Terminal()
    bar = make_progress(10, "tiny", stream=out, env={})
    bar.update(3, reward=0.25, step_s=1.234)
    bar.close()
    text = out.getvalue()
    assert "\r" in text and "tiny" in text and "3/10" in text and "reward=0.250" in text and "s_per_step=1.23" in text


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_a_bad_interval_warns_and_keeps_the_default(raw: str) -> None:
    out = io.StringIO()
    progress = make_progress(10, "x", stream=out, env={EVERY_S_ENV: raw})
    assert isinstance(progress, LineProgress) and progress.every_s == 30
    assert f"{EVERY_S_ENV}={raw!r} ignored" in out.getvalue()
