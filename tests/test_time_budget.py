"""The per-test time budget names every test over it and fails the run (tests/time_budget.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from time_budget import BUILD_WAIT_PROPERTY, REFERENCE_PROBE_S, TimeBudget, speed_factor, speed_probe


def _session_files(tmp_path: Path) -> None:
    """What a pytest session under this suite's conftest needs, copied into `tmp_path`."""
    tests = Path(__file__).resolve().parent
    for helper in ("conftest.py", "time_budget.py", "side_env.py", "worker_groups.py"):
        (tmp_path / helper).write_text((tests / helper).read_text())


def _budget_env(**settings: str) -> dict[str, str]:
    """This environment for a nested session: enforced by default, no allowance for this machine's
    speed (the nested budgets are fractions of a second), and `settings` on top."""
    env = {k: v for k, v in os.environ.items() if k not in ("RELAX_TEST_BUDGET_ENFORCE", "PYTEST_ADDOPTS")}
    return env | {"RELAX_TEST_SPEED_FACTOR": "1"} | settings


def _report(nodeid: str, when: str, duration: float, waited: float = 0.0) -> pytest.TestReport:
    properties = [(BUILD_WAIT_PROPERTY, waited)] if waited else []
    return pytest.TestReport(nodeid, ("f.py", 1, nodeid), {}, "passed", None, when, [], duration,
                             user_properties=properties)


def _as_fast_as_the_reference() -> float:
    return 1.0


def test_setup_call_and_teardown_add_up_per_test() -> None:
    budget = TimeBudget(10.0, _as_fast_as_the_reference)
    for when, s in (("setup", 6.0), ("call", 3.0), ("teardown", 2.0)):
        budget.add(_report("a.py::slow", when, s))
    budget.add(_report("a.py::fast", "call", 9.9))
    assert budget.over() == [("a.py::slow", 11.0)]
    lines = budget.lines()
    assert "1 test(s) over the 10 s budget of one test" in lines[0] and "docs/testing.md" in lines[0]
    assert lines[1].split() == ["11.0", "s", "a.py::slow"]


def test_time_spent_waiting_for_an_environment_build_is_not_the_tests() -> None:
    budget = TimeBudget(10.0, _as_fast_as_the_reference)
    budget.add(_report("a.py::waits", "setup", 95.0, waited=90.0))
    budget.add(_report("a.py::waits", "call", 4.0))
    assert budget.over() == [] and budget.seconds["a.py::waits"] == 9.0


def test_the_times_file_gets_a_line_per_test_with_its_end_and_its_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    times = tmp_path / "times.tsv"
    monkeypatch.setenv("RELAX_TEST_TIMES", str(times))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # written where the reports arrive
    budget = TimeBudget(10.0, _as_fast_as_the_reference)
    before = time.time()
    for when, s in (("setup", 1.0), ("call", 2.5), ("teardown", 0.5)):
        budget.add(_report("a.py::t", when, s))
    seconds, outcome, node, ended, worker = times.read_text().rstrip("\n").split("\t")
    assert (seconds, outcome, node, worker) == ("4.0", "passed", "a.py::t", "-")
    assert before - 0.1 <= float(ended) <= time.time() + 0.1


def test_no_line_when_every_test_is_within_the_budget() -> None:
    budget = TimeBudget(10.0, _as_fast_as_the_reference)
    budget.add(_report("a.py::t", "call", 10.0))
    assert budget.over() == [] and budget.lines() == []


def test_a_slower_machine_gets_proportionally_more_and_the_speed_is_measured_only_when_needed() -> None:
    probes: list[int] = []

    def twice_as_slow() -> float:
        probes.append(1)
        return 2.0

    budget = TimeBudget(10.0, twice_as_slow)
    budget.add(_report("a.py::t", "call", 9.0))
    assert budget.over() == [] and budget.lines() == [] and probes == []  # nothing near it: no probe
    budget.add(_report("a.py::close", "call", 19.0))  # over 10 s, within 10 s x 2
    budget.add(_report("a.py::slow", "call", 21.0))  # over both
    assert budget.over() == [("a.py::slow", 21.0)] and probes == [1]
    lines = budget.lines()
    assert probes == [1]  # measured once
    assert lines[0].startswith("1 test(s) over the 10 s budget of one test; x2.00 on this machine")
    assert lines[1].split() == ["21.0", "s", "a.py::slow"]
    assert lines[2].startswith("1 test(s) over 10 s but within this machine's 20 s (x2.00")
    assert lines[3].split() == ["19.0", "s", "a.py::close"]


def test_the_slower_of_the_speeds_at_the_start_and_at_the_end_counts() -> None:
    # The host ran twice as slow when the session started and at reference speed at the end (the
    # CI run of 2026-12-02): the tests ran slow, so the allowance is the start's.
    speeds = iter([2.0, 1.0])
    budget = TimeBudget(10.0, lambda: next(speeds))
    budget.note_start()
    budget.add(_report("a.py::close", "call", 19.0))
    assert budget.over() == [] and budget.factor() == 2.0
    assert budget.lines()[0].startswith("1 test(s) over 10 s but within this machine's 20 s (x2.00")
    # ... and the other way round: slow only at the end.
    speeds = iter([1.0, 1.5])
    budget = TimeBudget(10.0, lambda: next(speeds))
    budget.note_start()
    budget.add(_report("a.py::slow", "call", 16.0))
    assert budget.over() == [("a.py::slow", 16.0)] and budget.factor() == 1.5


def test_the_speed_factor_is_never_below_one_and_can_be_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RELAX_TEST_SPEED_FACTOR", raising=False)
    assert speed_factor(lambda: REFERENCE_PROBE_S / 3) == 1.0  # a faster machine keeps 180 s
    assert speed_factor(lambda: REFERENCE_PROBE_S * 1.5) == pytest.approx(1.5)
    monkeypatch.setenv("RELAX_TEST_SPEED_FACTOR", "2.5")
    assert speed_factor(lambda: REFERENCE_PROBE_S) == 2.5
    monkeypatch.setenv("RELAX_TEST_SPEED_FACTOR", "0.5")
    assert speed_factor(lambda: REFERENCE_PROBE_S * 4) == 1.0


def test_the_speed_probe_times_its_loop() -> None:
    assert 0.0 < speed_probe() < 60.0


def test_a_session_with_a_test_over_the_budget_fails_and_names_it(tmp_path: Path) -> None:
    # A real pytest session under this conftest, with a budget of 0.2 s and one test of 0.3 s.
    _session_files(tmp_path)
    (tmp_path / "test_sleepy.py").write_text(textwrap.dedent("""
        import time
        def test_sleeps():
            time.sleep(0.3)
        def test_quick():
            pass
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=_budget_env(RELAX_TEST_BUDGET_S="0.2"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    assert "1 test(s) over the 0.2 s budget" in done.stdout
    assert "test_sleepy.py::test_sleeps" in done.stdout and "test_quick" not in done.stdout.split("budget")[-1]


def test_with_enforcing_turned_off_the_session_names_the_test_and_passes(tmp_path: Path) -> None:
    _session_files(tmp_path)
    (tmp_path / "test_sleepy.py").write_text("import time\ndef test_sleeps():\n    time.sleep(0.3)\n")
    env = _budget_env(RELAX_TEST_BUDGET_S="0.2", RELAX_TEST_BUDGET_ENFORCE="0")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 test(s) over the 0.2 s budget" in done.stdout and "test_sleepy.py::test_sleeps" in done.stdout


_WAITS_FOR_BUILDS = """
import os, threading
from pathlib import Path
from side_env import MEGATRON, SGLANG

def _ends_after(name, seconds, rc):
    builds = Path(os.environ["RELAX_ENV_BUILDS"])
    threading.Timer(seconds, lambda: (builds / f"{name}.rc").write_text(f"{rc}\\n")).start()

def test_waits_for_a_build_that_succeeds():
    _ends_after("sglang-env", 0.6, 0)
    SGLANG.wait_for_build()
    assert (Path(os.environ["RELAX_ENV_BUILDS"]) / "sglang-env.rc").exists()  # returned once the build ended

def test_waits_for_a_build_that_fails():
    _ends_after("megatron-env", 0.6, 2)
    MEGATRON.wait_for_build()
"""


def test_a_test_waits_for_a_background_build_and_the_wait_is_not_its_time(tmp_path: Path) -> None:
    # tools/test-all's protocol: <target>.log while a build runs, <target>.rc once it ended. Each
    # test waits 0.6 s; the budget is 0.3 s, enforced: only the failed build may fail a test.
    _session_files(tmp_path)
    (tmp_path / "test_waits.py").write_text(_WAITS_FOR_BUILDS)
    builds = tmp_path / "builds"
    builds.mkdir()
    (builds / "sglang-env.log").write_text("setup-sglang-cpu: done\n")
    (builds / "megatron-env.log").write_text("setup-megatron-cpu: install\nerror: no space left on device\n")
    env = _budget_env(RELAX_TEST_BUDGET_S="0.3", RELAX_ENV_BUILDS=str(builds))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_waits.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 passed" in done.stdout and "over the 0.3 s budget" not in done.stdout
    assert "FAILED test_waits.py::test_waits_for_a_build_that_fails" in done.stdout
    assert "building the Megatron environment failed (exit 2)" in done.stdout
    assert "no space left on device" in done.stdout and str(builds / "megatron-env.log") in done.stdout
