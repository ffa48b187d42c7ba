"""The per-test time budget names every test over it and fails the run (tests/time_budget.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from time_budget import BUILD_WAIT_PROPERTY, TimeBudget


def _session_files(tmp_path: Path) -> None:
    """What a pytest session under this suite's conftest needs, copied into `tmp_path`."""
    tests = Path(__file__).resolve().parent
    for helper in ("conftest.py", "time_budget.py", "side_env.py", "worker_groups.py"):
        (tmp_path / helper).write_text((tests / helper).read_text())


def _report(nodeid: str, when: str, duration: float, waited: float = 0.0) -> pytest.TestReport:
    properties = [(BUILD_WAIT_PROPERTY, waited)] if waited else []
    return pytest.TestReport(nodeid, ("f.py", 1, nodeid), {}, "passed", None, when, [], duration,
                             user_properties=properties)


def test_setup_call_and_teardown_add_up_per_test() -> None:
    budget = TimeBudget(10.0)
    for when, s in (("setup", 6.0), ("call", 3.0), ("teardown", 2.0)):
        budget.add(_report("a.py::slow", when, s))
    budget.add(_report("a.py::fast", "call", 9.9))
    assert budget.over() == [("a.py::slow", 11.0)]
    lines = budget.lines()
    assert "1 test(s) over the 10 s budget of one test" in lines[0] and "docs/testing.md" in lines[0]
    assert lines[1].split() == ["11.0", "s", "a.py::slow"]


def test_time_spent_waiting_for_an_environment_build_is_not_the_tests() -> None:
    budget = TimeBudget(10.0)
    budget.add(_report("a.py::waits", "setup", 95.0, waited=90.0))
    budget.add(_report("a.py::waits", "call", 4.0))
    assert budget.over() == [] and budget.seconds["a.py::waits"] == 9.0


def test_no_line_when_every_test_is_within_the_budget() -> None:
    budget = TimeBudget(10.0)
    budget.add(_report("a.py::t", "call", 10.0))
    assert budget.over() == [] and budget.lines() == []


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
                          cwd=tmp_path, env={**os.environ, "RELAX_TEST_BUDGET_S": "0.2", "RELAX_TEST_BUDGET_ENFORCE": "1"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    assert "1 test(s) over the 0.2 s budget" in done.stdout
    assert "test_sleepy.py::test_sleeps" in done.stdout and "test_quick" not in done.stdout.split("budget")[-1]


def test_without_enforcing_the_session_names_the_test_and_passes(tmp_path: Path) -> None:
    _session_files(tmp_path)
    (tmp_path / "test_sleepy.py").write_text("import time\ndef test_sleeps():\n    time.sleep(0.3)\n")
    env = {k: v for k, v in os.environ.items() if k != "RELAX_TEST_BUDGET_ENFORCE"} | {"RELAX_TEST_BUDGET_S": "0.2"}
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
    env = os.environ | {"RELAX_TEST_BUDGET_S": "0.3", "RELAX_TEST_BUDGET_ENFORCE": "1", "RELAX_ENV_BUILDS": str(builds)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_waits.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 passed" in done.stdout and "over the 0.3 s budget" not in done.stdout
    assert "FAILED test_waits.py::test_waits_for_a_build_that_fails" in done.stdout
    assert "building the Megatron environment failed (exit 2)" in done.stdout
    assert "no space left on device" in done.stdout and str(builds / "megatron-env.log") in done.stdout
