"""`relax-hpc faults SPEC --in-one-run`: the faults injected one after another into one run.

The run (OUT/in-one-run/) is SPEC with the roles every fault needs. The first fault comes after
step 3, as in a run of its own; each next one once the run has recovered from the one before:
a step recorded after it (not the step that was in flight), `FAULT_GAP` more steps trained, and
the role it hit back at work in status.json. A fault that kills the driver starts the run again
(a requeue) and the chain goes on in the new run. At the end the exactly-once check covers the
whole run, so every fault's row carries the run's samples, duplicated and lost; what each fault
cost (in place, global) is read from the restart counters of the step records around it.

The order is fixed (`ONE_RUN_ORDER`), whatever order the faults are asked in: a role's failures
count until the next global restart (relax_hpc/ops/health.py), so the fault that needs three
failures of the Reference in a row comes before the other Reference faults, and the faults that
start the run again come last. disk-full needs its checkpoints on a small file system from the
start: it always gets a run of its own. One run of the spec for many faults instead of a run
each: the start-up (Ray, the roles, the models) is paid once, and the run shows it survives a
sequence of faults, not just one. A fault that breaks the run leaves the ones after it untried
(named in their rows).
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

from relax_hpc.faults.fault import (
    FAULT_SPEC,
    INJECT_AFTER,
    Fault,
    FaultRow,
    checked_spec_text,
    derive_spec,
    exactly_once_counts,
    fresh_job_dir,
    judge,
    read_summary,
    restart_kind,
    time_to_recover,
)
from relax_hpc.faults.process import JobProcess, StepRecord
from relax_hpc.faults.scenarios import (
    FaultJob,
    Injection,
    continue_stopped,
    kill_driver_and_start_again,
    signal_role,
    stop_corrupt_and_start_again,
)
from relax_hpc.spec import JobSpec

ONE_RUN_ORDER = ("kill-reference-3x", "kill-engine", "kill-reference", "hang-reference", "kill-actor-fwd",
                 "kill-trainer-rank", "kill-critic", "kill-driver", "corrupt-checkpoint")
FAULT_GAP = 2  # steps trained after a fault's injection (and its recovery) before the next fault
IN_PLACE, GLOBAL = "health/in_place_restarts", "health/global_restarts"


def split_for_one_run(faults: Sequence[Fault]) -> tuple[list[Fault], list[Fault]]:
    """(the faults that share one run, in ONE_RUN_ORDER; those that need a run of their own)."""
    chained = sorted((f for f in faults if f.name in ONE_RUN_ORDER), key=lambda f: ONE_RUN_ORDER.index(f.name))
    return chained, [f for f in faults if f.name not in ONE_RUN_ORDER]


def one_run_steps(steps: int, faults: int) -> int:
    """Steps of a run with `faults` faults: each FAULT_GAP steps after the one before, and the last
    followed by a few (its recovery shows in a step after the one in flight)."""
    return max(steps, INJECT_AFTER + FAULT_GAP * (faults + 1) + 2)


def restart_between(records: Sequence[StepRecord], before: int, until: int) -> str:
    """What the run's own health did between record `before` (the last one before a fault) and
    record `until` (the last one before the next fault, or the last): "global" when a global
    restart was counted, else "in place" when a role was restarted in place, else "none"."""
    if before < 0 or until <= before:
        return "none"

    def counted(name: str) -> float:
        return max(float(r.scalars.get(name, 0)) for r in records[before + 1: until + 1]) - float(
            records[before].scalars.get(name, 0))

    return restart_kind(False, {"global": counted(GLOBAL) > 0, "in_place": counted(IN_PLACE) > 0})


def run_in_one_run(spec: JobSpec, faults: Sequence[Fault], job_dir: Path, steps: int,
                   timeout_s: float) -> list[FaultRow]:
    """Every fault of `faults` (ONE_RUN_ORDER; none of a run of its own) into one run of `spec`
    in `job_dir`, of one_run_steps(steps) steps; a row per fault (module docstring). `timeout_s`
    holds for each fault: to its injection, and from it to the next (or the run's end)."""
    steps = one_run_steps(steps, len(faults))
    derived = derive_spec(spec, faults, job_dir, steps)
    text = checked_spec_text(derived, faults)
    fresh_job_dir(job_dir)
    (job_dir / FAULT_SPEC).write_text(text)
    job = FaultJob(job_dir / FAULT_SPEC, job_dir, INJECT_AFTER, timeout_s, dict(os.environ))
    chain = _Chain(job, faults)
    chain.run()
    return chain.rows(steps)


class _Chain:
    """The faults of one run, injected in turn (`run`), then judged (`rows`)."""

    def __init__(self, job: FaultJob, faults: Sequence[Fault]) -> None:
        self.job, self.faults = job, list(faults)
        self.injections = [Injection() for _ in faults]
        self.back_at_work: list[Callable[[], bool]] = [lambda: True for _ in faults]  # after each fault
        self.end = Injection()  # the run's last exit
        self.stopped: list[int] = []  # processes a hang fault stopped

    def run(self) -> None:
        job = self.job
        run = job.start(self.injections[0])
        try:
            for k, (fault, injection) in enumerate(zip(self.faults, self.injections)):
                if k > 0:
                    job.renew_deadline()
                if not self._ready_for(k, run):  # said in the fault's row (k = 0) or the one before
                    if k == 0:
                        self._untried_from(1, f"the run did not get to {fault.name}")
                    else:
                        self._untried_from(k, f"the run did not recover from {self.faults[k - 1].name}")
                    return
                self.back_at_work[k] = self._back_at_work(fault)
                after = self._inject(fault, run, injection)
                if after is None:
                    self._untried_from(k + 1, f"the run broke at {fault.name}")
                    return
                run = after
            job.renew_deadline()
            job.wait_exit(run, self.end)
        finally:
            continue_stopped(run, self.stopped)
            job.finish(run, self.end)

    def _ready_for(self, k: int, run: JobProcess) -> bool:
        """Wait until fault k may come: step INJECT_AFTER for the first; for a next one, the run
        recovered from the one before (a problem of that fault when it does not)."""
        job = self.job
        if k == 0:
            return job.reach_step(run, self.injections[0])
        fault, injection = self.faults[k - 1], self.injections[k - 1]
        since = job.tail.records[injection.first_after - 1].step if injection.first_after else 0

        def recovered() -> bool:
            return (time_to_recover(injection, job.tail.records) is not None
                    and job.tail.last_step() >= since + FAULT_GAP and self.back_at_work[k - 1]())

        what = f"the run to recover from {fault.name} and train {FAULT_GAP} more steps" + (
            " with a replacement engine active (status.json)" if fault.needs == "engines" else
            f" with {fault.role} back at work (status.json)" if fault.role else "")
        return job.wait(run, injection, recovered, what)

    def _back_at_work(self, fault: Fault) -> Callable[[], bool]:
        """Read before the fault: whether what it hit is back at work after it. A killed engine is
        replaced by a new one (another id): as many engines active as before; a role is restarted
        under its name: `times` more restarts in status.json, running."""
        job = self.job
        if fault.needs == "engines":
            engines = job.active_engines()
            return lambda: job.active_engines() >= engines
        if fault.role:
            restarts = job.role_restarts(fault.role) + fault.times
            return lambda: job.role_back_at_work(fault.role, restarts)
        return lambda: True

    def _inject(self, fault: Fault, run: JobProcess, injection: Injection) -> JobProcess | None:
        """Inject one fault into the live run: the run that goes on (a new one after a driver
        fault), or None when it could not be done (said in `injection`)."""
        inject: Callable[[FaultJob, JobProcess, Injection], JobProcess | None]
        if fault.role:
            signalled: list[int] = []
            ok = signal_role(self.job, run, injection, fault.role, fault.sig, fault.times, signalled)
            if fault.sig == signal.SIGSTOP:
                self.stopped += signalled
            return run if ok else None
        if fault.name == "kill-driver":
            inject = kill_driver_and_start_again
        else:
            assert fault.name == "corrupt-checkpoint", fault
            inject = stop_corrupt_and_start_again
        return inject(self.job, run, injection)

    def _untried_from(self, k: int, why: str) -> None:
        for injection in self.injections[k:]:
            injection.problems.append(f"not injected: {why}")

    def rows(self, steps: int) -> list[FaultRow]:
        records = self.job.tail.records
        started = max(injection.last_run_started for injection in self.injections)
        summary = read_summary(self.job.job_dir, started)
        counts = exactly_once_counts(self.job.job_dir)
        rows = []
        for k, (fault, injection) in enumerate(zip(self.faults, self.injections)):
            if injection.expect_start_step is not None:
                _check_resumed_from(injection, records)
            later = self.injections[k + 1].first_after if k + 1 < len(self.faults) else 0
            until = (later or len(records)) - 1
            restart = (restart_kind(True, None) if injection.rerun
                       else restart_between(records, injection.first_after - 1, until))
            judged = dataclasses.replace(injection, exit_codes=injection.exit_codes + self.end.exit_codes,
                                         problems=injection.problems + self.end.problems,
                                         last_log_line=self.end.last_log_line or injection.last_log_line)
            row = judge(fault, judged, steps, summary, counts, time_to_recover(injection, records[:until + 1]),
                        restart=restart if injection.injected else "-")
            rows.append(dataclasses.replace(row, job_dir=str(self.job.job_dir), run_steps=steps))
        return rows


def _check_resumed_from(injection: Injection, records: Sequence[StepRecord]) -> None:
    """The run started again after a damaged checkpoint resumed from the one before: its first
    step record is the step after that checkpoint. (judge's own check reads summary.json, which
    names the start of the last run only.)"""
    expected = injection.expect_start_step
    assert expected is not None
    first = records[injection.first_after].step if len(records) > injection.first_after else None
    if first is not None and first != expected + 1:
        injection.problems.append(f"the rerun started from step {first - 1}, not from the checkpoint before the "
                                  f"damaged one (step {expected})")
    injection.expect_start_step = None
