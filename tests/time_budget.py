"""The per-test time budget of the test command (docs/testing.md, "Budget").

Every test's setup, call and teardown are added up (a module-scoped fixture is paid by the first
test that asks for it, so a shared start-up counts too). When the session ends, any test over
the budget fails the run, named with this rule: a new slow test is split or shares its start-up
the day it is written, instead of growing the suite unnoticed. `RELAX_TEST_BUDGET_ENFORCE=0` only
names them (a debugging session); `RELAX_TEST_BUDGET_S` sets another budget than 180 s.

The budget is 180 s on a machine as fast as the one it was set on. The machines of this kind run
at speeds a third apart within a day and at twice those apart from day to day (docs/testing.md,
"Machine drift"), so a slower machine gets proportionally more: when a test is over 180 s, a
fixed one-core loop (`speed_probe`) is timed once the tests have stopped, and the budget is
multiplied by how much slower than on the reference machine it ran (never by less than 1).
The loop is also timed when the session starts (`TimeBudget.note_start`), and the slower of the
two counts: a host whose speed drifted during a forty-minute run (a CI run failed that way on
2026-12-02, its hour-long slow spell over by the end) is judged at its slower speed.
`RELAX_TEST_SPEED_FACTOR` fixes that factor instead (1: no allowance).

Time spent waiting for an environment that tools/test-all builds beside the tests is left out
(`BUILD_WAIT_PROPERTY`).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable

import pytest

DEFAULT_BUDGET_S = 180.0
BUILD_WAIT_PROPERTY = "build_wait_s"
# `speed_probe()` on the 2-core machine the budget was set on (2026-12-01: 0.30-0.35 s, while
# docs/testing.md's speed task took 1.66-1.71 s; the suite's longest test took 113-131 s there
# beside the other worker).
REFERENCE_PROBE_S = 0.32
PROBE_ADDITIONS = 10_000_000


def budget_s() -> float:
    return float(os.environ.get("RELAX_TEST_BUDGET_S", DEFAULT_BUDGET_S))


def times_file() -> str | None:
    """RELAX_TEST_TIMES: a file that gets one line per finished test (seconds, outcome, node id,
    when it ended as Unix time, the xdist worker that ran it), written as the run goes, so a stopped
    run still leaves its table, and the two workers' timelines can be drawn (docs/testing.md)."""
    return os.environ.get("RELAX_TEST_TIMES") or None


def enforced() -> bool:
    return os.environ.get("RELAX_TEST_BUDGET_ENFORCE", "1") != "0"


def speed_probe() -> float:
    """Seconds of a fixed loop of additions in this process, the best of three (the least
    disturbed by whatever else runs)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        total = 0
        for i in range(PROBE_ADDITIONS):
            total += i
        best = min(best, time.perf_counter() - start)
    return best


def speed_factor(probe: Callable[[], float] = speed_probe) -> float:
    """How many times slower than the reference machine this one runs (>= 1)."""
    fixed = os.environ.get("RELAX_TEST_SPEED_FACTOR")
    if fixed is not None:
        return max(1.0, float(fixed))
    return max(1.0, probe() / REFERENCE_PROBE_S)


def worker_of(report: pytest.TestReport) -> str:
    """The xdist worker ("gw0", ...) whose report this is; "-" in a plain run."""
    return str(getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "-"))


class TimeBudget:
    def __init__(self, limit_s: float, factor: Callable[[], float] = speed_factor) -> None:
        self.limit_s = limit_s
        self.seconds: dict[str, float] = defaultdict(float)
        self.outcomes: dict[str, str] = {}
        self._factor = factor
        self._measured: float | None = None
        self._at_start = 1.0

    def note_start(self) -> None:
        """Time the machine before the first test: the allowance is the slower of this and the
        speed once the tests have stopped."""
        self._at_start = self._factor()

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
                out.write(f"{self.seconds[report.nodeid]:.1f}\t{outcome}\t{report.nodeid}\t"
                          f"{time.time():.1f}\t{worker_of(report)}\n")

    def factor(self) -> float:
        """This machine's allowance, measured once, and only when a test is over the bare budget."""
        if not self._over(self.limit_s):
            return 1.0
        if self._measured is None:
            self._measured = max(self._factor(), self._at_start)
        return self._measured

    def allowed_s(self) -> float:
        return self.limit_s * self.factor()

    def _over(self, limit_s: float) -> list[tuple[str, float]]:
        return sorted(((node, s) for node, s in self.seconds.items() if s > limit_s), key=lambda x: -x[1])

    def over(self) -> list[tuple[str, float]]:
        """The tests over the budget, this machine's allowance included: the ones that fail the run."""
        return self._over(self.allowed_s())

    def lines(self) -> list[str]:
        over, factor = self.over(), self.factor()
        allowance = (f"; x{factor:.2f} on this machine, slower than the reference by a fixed loop"
                     if factor > 1.0 else "")
        lines = []
        if over:
            lines += [f"{len(over)} test(s) over the {self.limit_s:g} s budget of one test{allowance} "
                      "(setup + call + teardown; docs/testing.md, 'Budget'): split it, or share its start-up "
                      "with a module or session fixture",
                      *(f"  {s:7.1f} s  {node}" for node, s in over)]
        spared = [(node, s) for node, s in self._over(self.limit_s) if s <= self.allowed_s()]
        if spared:
            lines += [f"{len(spared)} test(s) over {self.limit_s:g} s but within this machine's "
                      f"{self.allowed_s():.0f} s (x{factor:.2f}; docs/testing.md, 'Budget'): close to the budget",
                      *(f"  {s:7.1f} s  {node}" for node, s in spared)]
        return lines
