"""`relax-hpc faults SPEC`: run a job spec once per fault, inject the fault mid-run, and check
the run recovered with every planned sample trained exactly once.

    relax-hpc faults jobspecs/tiny_local.toml                  # all faults, 8 steps each
    relax-hpc faults SPEC --only kill-driver disk-full --out runs/my-faults

Each fault gets a fresh job directory, OUT/<fault>/ (default OUT: runs/faults-<spec name>),
holding fault-spec.toml (SPEC with a few steps, frequent checkpoints, the trajectory archive,
fast heartbeats and the roles the fault needs), the run's log fault.log, and the run's own
files. The run is `relax-hpc run fault-spec.toml` as a subprocess (relax_hpc/faults/
scenarios.py says how each fault is injected; suite.py runs the faults, chain.py several in one
run: --in-one-run). Afterwards the exactly-once check of the trajectory archive
(relax_hpc/ops/exactly_once.py) counts duplicated and lost samples, and summary.json gives the
samples trained and the restarts. The table and OUT/faults.json hold a
row per fault; the exit status is 0 only when every fault that ran was recovered.
docs/operations.md, "Fault suite".
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_hpc.spec import JobSpec, NotifySpec, parse_spec, spec_to_toml
from relax_hpc.spec.schema import CriticSpec

if TYPE_CHECKING:
    from relax_hpc.faults.process import StepRecord
    from relax_hpc.faults.scenarios import FaultJob, Injection

DEFAULT_STEPS = 8
MIN_STEPS = 6  # a save that fails (step 4), one after it that succeeds, and the last
INJECT_AFTER = 3  # steps trained before a fault
SAVE_INTERVAL = 2
HEARTBEAT_S, STALE_S = 0.5, 4.0  # a hung role is noticed within seconds
DEFAULT_TIMEOUT_S = 300.0  # per run of the spec
FAULT_SPEC = "fault-spec.toml"  # also marks a directory the suite may replace
REPORT = "faults.json"
KL_COEF = 0.01  # when the spec has none: the Reference role needs a use
ONE_RUN = "in-one-run"  # the job directory (OUT/in-one-run/) of the faults run in one run


@dataclass(frozen=True)
class Fault:
    name: str
    what: str  # one line: --help and the docs
    needs: str = ""  # "engines", "reference", "actor_fwd", "ranks": what the spec must run
    role: str = ""  # the heartbeat role whose process is signalled
    sig: signal.Signals = signal.SIGKILL
    times: int = 1  # the role's process is signalled this many times in a row (each replacement too)


FAULTS: tuple[Fault, ...] = (
    Fault("kill-engine", "SIGKILL of rollout engine engine_1 (of 2, each in its own Ray actor)",
          "engines", "engine_1"),
    Fault("kill-actor-fwd", "SIGKILL of the ActorFwd role", "actor_fwd", "actor_fwd"),
    Fault("kill-reference", "SIGKILL of the Reference role", "reference", "reference"),
    Fault("kill-reference-3x", "SIGKILL of the Reference role, then of its replacement, twice: the third "
                               "failure of one role restarts the whole run", "reference", "reference", times=3),
    Fault("kill-trainer-rank", "SIGKILL of trainer rank 1 (of 2)", "ranks", "trainer_rank_1"),
    Fault("kill-critic", "SIGKILL of critic rank 1 (of 2, fsdp2; PPO, advantage = \"gae\"): the run restarts "
                         "from its newest checkpoint, the critic's included", "critic", "critic_rank_1"),
    Fault("kill-driver", "SIGKILL of the driver and every process it started; the run is started "
                         "again and resumes from its newest checkpoint (what a Slurm requeue does)"),
    Fault("hang-reference", "SIGSTOP of the Reference role: it stops beating, goes stale and must be "
                            "replaced", "reference", "reference", signal.SIGSTOP),
    Fault("corrupt-checkpoint", "the run is stopped (SIGTERM: it checkpoints), the newest checkpoint's "
                                "data file truncated, the run started again: it must resume from the "
                                "checkpoint before"),
    Fault("disk-full", "JOBDIR/checkpoints on a small tmpfs, filled up after the first save: the next "
                       "save fails, the run goes on and a later save succeeds (needs root)"),
)
FAULT_NAMES: tuple[str, ...] = tuple(f.name for f in FAULTS)


def fault_named(name: str) -> Fault:
    for fault in FAULTS:
        if fault.name == name:
            return fault
    raise ValueError(f"no fault {name!r}; the faults are {', '.join(FAULT_NAMES)}")


def derive_spec(spec: JobSpec, faults: Fault | Sequence[Fault], job_dir: Path, steps: int) -> JobSpec:
    """`spec` as the run of one fault (or of several in one run): in `job_dir`, `steps` steps, a
    checkpoint every 2, the trajectory archive, heartbeats every 0.5 s (stale after 4), the roles
    every fault needs, no alerts or trackers (a fault run pages nobody), and the model and data
    paths absolute."""
    faults = (faults,) if isinstance(faults, Fault) else tuple(faults)
    r, t, a = spec.rollout, spec.train, spec.algorithm
    needs = {fault.needs for fault in faults}
    if "engines" in needs:
        r = dataclasses.replace(r, num_engines=max(2, r.num_engines))
    if "reference" in needs:
        t = dataclasses.replace(t, reference_role=True)
        a = dataclasses.replace(a, kl_coef=a.kl_coef or KL_COEF)
    if "actor_fwd" in needs:
        t = dataclasses.replace(t, actor_fwd_role=True)
    if "ranks" in needs:
        t = dataclasses.replace(t, num_processes=max(2, t.num_processes))
    critic = spec.critic
    if "critic" in needs:  # PPO with a critic: the critic writes the advantages
        a = dataclasses.replace(a, advantage="gae", name="grpo" if a.name == "opd" else a.name)
        t = dataclasses.replace(t, advantages_role=False)
        # A critic of its own warms up one step first, as PPO runs usually start: the run also
        # crosses the hand-over from the warm-up step to the actor's first.
        # Two ranks sharded (fsdp2), so the restart resumes a sharded critic from its DCP checkpoint.
        critic = critic or CriticSpec(warmup_steps=1, strategy="fsdp2")
        critic = dataclasses.replace(critic, num_processes=max(2, critic.num_processes))
    suffix = faults[0].name if len(faults) == 1 else ONE_RUN
    return dataclasses.replace(
        spec,
        job=dataclasses.replace(spec.job, name=f"{spec.job.name}-{suffix}"[:64], output_dir=str(job_dir)),
        model=dataclasses.replace(spec.model, path=str(Path(spec.model.path).absolute())),
        data=dataclasses.replace(spec.data, path=str(Path(spec.data.path).absolute())),
        rollout=r, algorithm=a, critic=critic,
        train=dataclasses.replace(t, steps=steps),
        checkpoint=dataclasses.replace(spec.checkpoint, save_interval=SAVE_INTERVAL,
                                       keep_last=max(2, spec.checkpoint.keep_last), resume=True),
        metrics=dataclasses.replace(spec.metrics, trajectory_archive=True, plot=False, wandb_project=None,
                                    clearml_project=None, mlflow_experiment=None),
        notify=NotifySpec(),
        health=dataclasses.replace(spec.health, heartbeat_s=HEARTBEAT_S, stale_s=STALE_S),
    )


def checked_spec_text(spec: JobSpec, faults: Fault | Sequence[Fault]) -> str:
    """The derived spec as TOML, loaded back once so a conflict with SPEC shows before any run."""
    from relax_hpc.spec import SpecError

    faults = (faults,) if isinstance(faults, Fault) else tuple(faults)
    what = f"fault {faults[0].name}" if len(faults) == 1 else f"faults {', '.join(f.name for f in faults)} in one run"
    text = spec_to_toml(spec)
    try:
        parse_spec(text, f"{FAULT_SPEC} of {what}")
    except SpecError as e:
        raise ValueError(f"{what} needs SPEC changed in a way it does not allow (leave that "
                         f"fault out with --only): {e}") from e
    return text


@dataclass(frozen=True)
class FaultRow:
    """One line of the table (and of OUT/faults.json)."""

    fault: str
    ran: bool
    recovered: bool
    restart: str  # "in place", "global", "rerun", "none", "-" when not run
    recover_s: float | None  # from the injection to the first step that shows the run going on
    samples: int | None  # summary.json samples_trained
    duplicated: int | None
    lost: int | None
    note: str = ""
    job_dir: str = ""  # the run's: OUT/<fault>/, or OUT/in-one-run/ shared by the faults run in one run
    run_steps: int | None = None  # the steps of that run


def restart_kind(rerun: bool, health: Any) -> str:
    """What brought the run back: its own restarts (summary.json "health"), and the suite's rerun."""
    kinds = []
    if isinstance(health, dict):
        if health.get("global"):
            kinds.append("global")
        elif health.get("in_place"):
            kinds.append("in place")
    if rerun:
        kinds.append("rerun")
    return ", ".join(kinds) or "none"


def time_to_recover(injection: Injection, records: Sequence[StepRecord]) -> float | None:
    """Seconds from the injection to the first metrics record that proves the run went on: after a
    rerun, the rerun's first; otherwise the first for a step other than the one in flight at the
    injection (that one may have been complete already)."""
    if injection.injected_at is None:
        return None
    for record in records[injection.first_after:]:
        if injection.in_flight is None or record.step != injection.in_flight:
            return max(0.0, record.seen - injection.injected_at)
    return None


def judge(fault: Fault, injection: Injection, steps: int, summary: dict[str, Any] | None,
          counts: tuple[int, int] | str, recover_s: float | None, restart: str | None = None) -> FaultRow:
    """The row of one fault: recovered when the fault was injected, the last run exited 0 at
    step `steps`, no sample was duplicated or lost, and the fault's own checks held.
    `counts`: (duplicated, lost) of the exactly-once check, or why it could not run. `restart`:
    what brought the run back, when known otherwise than from summary.json (faults in one run)."""
    if injection.not_run:
        return FaultRow(fault.name, False, False, "-", None, None, None, None, injection.not_run)
    problems = list(injection.problems)
    code = injection.exit_codes[-1] if injection.exit_codes else None
    if injection.injected and code not in (0, None):
        problems.append(f"the run failed (exit {code}): {injection.last_log_line}")
    if summary is None:
        problems.append("the last run wrote no summary.json")
    else:
        if summary.get("end_step") != steps:
            problems.append(f"the run ended at step {summary.get('end_step')} of {steps}")
        if injection.expect_start_step is not None and summary.get("start_step") != injection.expect_start_step:
            problems.append(f"the rerun started from step {summary.get('start_step')}, not from the checkpoint "
                            f"before the damaged one (step {injection.expect_start_step})")
    duplicated = lost = None
    if isinstance(counts, str):
        problems.append(f"no exactly-once check: {counts}")
    else:
        duplicated, lost = counts
        if duplicated or lost:
            problems.append(f"exactly-once check: {duplicated} duplicated, {lost} lost")
    if not injection.injected and not injection.problems:
        problems.append("the fault was not injected")
    samples = summary.get("samples_trained") if summary else None
    if restart is None:
        restart = restart_kind(injection.rerun, summary.get("health") if summary else None)
    note = "; ".join(problems + injection.notes)
    return FaultRow(fault.name, True, not problems, restart, recover_s, samples, duplicated, lost, note)


COLUMNS = (("fault", 20), ("recovered", 10), ("restart", 15), ("recover s", 10), ("samples", 8),
           ("duplicated", 11), ("lost", 5))


def cells(row: FaultRow) -> list[str]:
    def number(value: float | None, form: str = "{}") -> str:
        return "-" if value is None else form.format(value)

    recovered = "not run" if not row.ran else "yes" if row.recovered else "NO"
    return [row.fault, recovered, row.restart, number(row.recover_s, "{:.1f}"), number(row.samples),
            number(row.duplicated), number(row.lost)]


def format_table(rows: Sequence[FaultRow]) -> list[str]:
    """Fixed-width lines: a header, one line per fault; then the notes of every row."""
    def line(cells: Sequence[str]) -> str:
        first, *rest = zip(cells, COLUMNS)
        return (first[0].ljust(first[1][1]) + "".join(c.rjust(w) for c, (_, w) in rest)).rstrip()

    lines = [line([name for name, _ in COLUMNS])]
    lines += [line(cells(row)) for row in rows]
    notes = [f"  {row.fault}: {row.note}" for row in rows if row.note]
    return lines + (["notes:", *notes] if notes else [])


def last_line(rows: Sequence[FaultRow]) -> str:
    """The counts of the faults, and the samples lost and duplicated of every run (faults that
    shared one run share its counts: counted once)."""
    ran = [row for row in rows if row.ran]
    survived = sum(row.recovered for row in ran)
    skipped = len(rows) - len(ran)
    runs = {row.job_dir or row.fault: row for row in ran}.values()
    lost = sum(row.lost or 0 for row in runs)
    duplicated = sum(row.duplicated or 0 for row in runs)
    not_run = f" ({skipped} not run)" if skipped else ""
    return f"faults survived: {survived}/{len(ran)}{not_run}, samples lost {lost}, duplicated {duplicated}"


def suite_ok(rows: Sequence[FaultRow]) -> bool:
    """Every fault that ran was recovered (a recovered row has 0 lost and 0 duplicated), and one ran."""
    ran = [row for row in rows if row.ran]
    return bool(ran) and all(row.recovered for row in ran)


def default_out(spec: JobSpec) -> Path:
    return Path("runs") / f"faults-{spec.job.name}"


def fresh_job_dir(path: Path) -> Path:
    """An empty directory for one fault; one left by an earlier suite (it holds fault-spec.toml)
    is replaced, anything else refused."""
    from relax_hpc.faults.inject import unmount

    if path.exists():
        if not (path / FAULT_SPEC).is_file():
            raise FileExistsError(f"{path} exists and is not a fault run's directory (no {FAULT_SPEC}); "
                                  "pass another --out")
        unmount(path / "checkpoints")  # a suite killed during the disk-full fault left it mounted
        shutil.rmtree(path)
    path.mkdir(mode=0o700, parents=True)
    return path


def run_fault(spec: JobSpec, fault: Fault, job_dir: Path, steps: int, timeout_s: float) -> FaultRow:
    """Run the fault's spec with the fault injected, then check it (FaultRow)."""
    from relax_hpc.faults.scenarios import FaultJob

    derived = derive_spec(spec, fault, job_dir, steps)
    text = checked_spec_text(derived, fault)
    fresh_job_dir(job_dir)
    (job_dir / FAULT_SPEC).write_text(text)
    job = FaultJob(job_dir / FAULT_SPEC, job_dir, INJECT_AFTER, timeout_s, dict(os.environ))
    injection = _inject(fault, job, derived)
    summary = read_summary(job_dir, injection.last_run_started)
    row = judge(fault, injection, steps, summary, exactly_once_counts(job_dir),
                time_to_recover(injection, job.tail.records))
    return dataclasses.replace(row, job_dir=str(job_dir), run_steps=steps)


def _inject(fault: Fault, job: FaultJob, spec: JobSpec) -> Injection:
    # Imported here: the scenarios import the checkpoint package (torch), `relax-hpc --help` does not.
    from relax_hpc.faults import scenarios

    if fault.role:
        return scenarios.role_fault(job, fault.role, fault.sig, fault.times)
    if fault.name == "kill-driver":
        return scenarios.driver_kill(job)
    if fault.name == "corrupt-checkpoint":
        return scenarios.corrupt_newest_checkpoint(job)
    assert fault.name == "disk-full", fault
    return scenarios.disk_full(job, Path(spec.model.path), spec.checkpoint.keep_last)


def read_summary(job_dir: Path, since: float) -> dict[str, Any] | None:
    """summary.json of the last run, if that run wrote one (an older file is an earlier run's)."""
    path = job_dir / "summary.json"
    try:
        if path.stat().st_mtime < since:
            return None
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def exactly_once_counts(job_dir: Path) -> tuple[int, int] | str:
    from relax_hpc.ops.archive import ArchiveError
    from relax_hpc.ops.exactly_once import check_exactly_once

    try:
        report = check_exactly_once(job_dir)
    except (ArchiveError, OSError) as e:
        return str(e)
    return report.duplicated, report.lost
