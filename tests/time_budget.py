"""The per-test time budget of the test command (docs/testing.md, "Budget").

Every test's setup, call and teardown are added up (a module-scoped fixture is paid by the first
test that asks for it, so a shared start-up counts too). When the session ends, any test over
`RELAX_TEST_BUDGET_S` (default 180 s) is named, and with `RELAX_TEST_BUDGET_ENFORCE=1` the run
fails: a new slow test is split or shares its start-up the day it is written, instead of growing
the suite unnoticed. Enforcing is not the default yet: beside the other worker the longest Slurm
jobs and the SGLang end-to-end run take 160-225 s, and a check that close to its limit on a 2-core
machine would fail by timing (docs/testing.md, "Budget"). Time spent waiting for an environment
that tools/test-all builds beside the tests is left out (`BUILD_WAIT_PROPERTY`).
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest

DEFAULT_BUDGET_S = 180.0
BUILD_WAIT_PROPERTY = "build_wait_s"


def budget_s() -> float:
    return float(os.environ.get("RELAX_TEST_BUDGET_S", DEFAULT_BUDGET_S))


def times_file() -> str | None:
    """RELAX_TEST_TIMES: a file that gets one line per finished test (seconds, outcome, node id),
    written as the run goes, so a stopped run still leaves its table (docs/testing.md)."""
    return os.environ.get("RELAX_TEST_TIMES") or None


def enforced() -> bool:
    return os.environ.get("RELAX_TEST_BUDGET_ENFORCE", "0") == "1"


class TimeBudget:
    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.seconds: dict[str, float] = defaultdict(float)
        self.outcomes: dict[str, str] = {}

    def add(self, report: pytest.TestReport) -> None:
        # Minus the time spent waiting for an environment that tools/test-all builds beside the
        # tests (tests/side_env.py): the build's time, not the test's.
        waited = sum(value for key, value in report.user_properties if key == BUILD_WAIT_PROPERTY)
        self.seconds[report.nodeid] += max(0.0, report.duration - waited)
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
        elif report.skipped:
            self.outcomes.setdefault(report.nodeid, "skipped")
        # Under xdist the controller sees every worker's reports too: only it writes the file.
        in_worker = "PYTEST_XDIST_WORKER" in os.environ
        if report.when == "teardown" and not in_worker and (path := times_file()):
            outcome = self.outcomes.get(report.nodeid, "passed")
            with open(path, "a", encoding="utf-8") as out:
                out.write(f"{self.seconds[report.nodeid]:.1f}\t{outcome}\t{report.nodeid}\n")

    def over(self) -> list[tuple[str, float]]:
        return sorted(((node, s) for node, s in self.seconds.items() if s > self.limit_s), key=lambda x: -x[1])

    def lines(self) -> list[str]:
        over = self.over()
        if not over:
            return []
        return [f"{len(over)} test(s) over the {self.limit_s:g} s budget of one test (setup + call + teardown; "
                "docs/testing.md, 'Budget'): split it, or share its start-up with a module or session fixture",
                *(f"  {s:7.1f} s  {node}" for node, s in over)]
