"""The per-test time budget names every test over it and fails the run (tests/time_budget.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from time_budget import TimeBudget


def _report(nodeid: str, when: str, duration: float) -> pytest.TestReport:
    return pytest.TestReport(nodeid, ("f.py", 1, nodeid), {}, "passed", None, when, [], duration)


def test_setup_call_and_teardown_add_up_per_test() -> None:
    budget = TimeBudget(10.0)
    for when, s in (("setup", 6.0), ("call", 3.0), ("teardown", 2.0)):
        budget.add(_report("a.py::slow", when, s))
    budget.add(_report("a.py::fast", "call", 9.9))
    assert budget.over() == [("a.py::slow", 11.0)]
    lines = budget.lines()
    assert "1 test(s) over the 10 s budget of one test" in lines[0] and "docs/testing.md" in lines[0]
    assert lines[1].split() == ["11.0", "s", "a.py::slow"]


def test_no_line_when_every_test_is_within_the_budget() -> None:
    budget = TimeBudget(10.0)
    budget.add(_report("a.py::t", "call", 10.0))
    assert budget.over() == [] and budget.lines() == []


def test_a_session_with_a_test_over_the_budget_fails_and_names_it(tmp_path: Path) -> None:
    # A real pytest session under this conftest, with a budget of 0.2 s and one test of 0.3 s.
    tests = Path(__file__).resolve().parent
    (tmp_path / "conftest.py").write_text((tests / "conftest.py").read_text())
    (tmp_path / "time_budget.py").write_text((tests / "time_budget.py").read_text())
    (tmp_path / "test_sleepy.py").write_text(textwrap.dedent("""
        import time
        def test_sleeps():
            time.sleep(0.3)
        def test_quick():
            pass
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env={**os.environ, "RELAX_TEST_BUDGET_S": "0.2", "RELAX_TEST_BUDGET_ENFORCE": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    assert "1 test(s) over the 0.2 s budget" in done.stdout
    assert "test_sleepy.py::test_sleeps" in done.stdout and "test_quick" not in done.stdout.split("budget")[-1]


def test_without_enforcing_the_session_names_the_test_and_passes(tmp_path: Path) -> None:
    tests = Path(__file__).resolve().parent
    (tmp_path / "conftest.py").write_text((tests / "conftest.py").read_text())
    (tmp_path / "time_budget.py").write_text((tests / "time_budget.py").read_text())
    (tmp_path / "test_sleepy.py").write_text("import time\ndef test_sleeps():\n    time.sleep(0.3)\n")
    env = {k: v for k, v in os.environ.items() if k != "RELAX_TEST_BUDGET_ENFORCE"} | {"RELAX_TEST_BUDGET_S": "0.2"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 test(s) over the 0.2 s budget" in done.stdout and "test_sleepy.py::test_sleeps" in done.stdout
