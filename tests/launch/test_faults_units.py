"""The fault suite's parts without a training run: spec derivation, verdicts, the table, the
metrics tail, the process session it kills, and the file-system faults."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_hpc.jobspecs import embedded_dir, with_embedded_inputs
from relax_hpc.faults.inject import (
    BALLAST,
    SmallFilesystem,
    corrupt_checkpoint,
    newest_and_previous,
    small_fs_bytes,
)
from relax_hpc.faults.process import JobProcess, MetricsTail, StepRecord, log_tail
from relax_hpc.faults.scenarios import Injection
from relax_hpc.faults.fault import (
    FAULT_NAMES,
    FAULT_SPEC,
    FAULTS,
    FaultRow,
    checked_spec_text,
    derive_spec,
    fault_named,
    format_table,
    fresh_job_dir,
    judge,
    last_line,
    restart_kind,
    suite_ok,
    time_to_recover,
)
from relax_hpc.spec import JobSpec, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]


def tiny_spec() -> JobSpec:
    path = embedded_dir() / "tiny_local.toml"
    return with_embedded_inputs(load_spec(path), path)


# -- the derived specs -------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAULT_NAMES)
def test_every_fault_spec_is_valid_and_holds_what_the_suite_relies_on(name: str, tmp_path: Path) -> None:
    fault = fault_named(name)
    derived = parse_spec(checked_spec_text(derive_spec(tiny_spec(), fault, tmp_path / name, 8), fault))
    assert derived.job_dir() == tmp_path / name
    assert derived.train.steps == 8
    assert (derived.checkpoint.save_interval, derived.checkpoint.resume) == (2, True)
    assert derived.checkpoint.keep_last >= 2  # the corrupt-checkpoint fault needs an older one
    assert derived.metrics.trajectory_archive  # the exactly-once check reads it
    assert (derived.health.heartbeat_s, derived.health.stale_s) == (0.5, 4.0)
    assert derived.notify.urls == [] and derived.notify.urls_file is None
    assert Path(derived.model.path).is_absolute() and Path(derived.data.path).is_file()
    assert derived.rollout.num_engines == (2 if name == "kill-engine" else 1)
    assert derived.train.reference_role == (name in ("kill-reference", "kill-reference-3x", "hang-reference"))
    assert derived.train.actor_fwd_role == (name == "kill-actor-fwd")
    assert derived.train.num_processes == (2 if name == "kill-trainer-rank" else 1)


def test_the_reference_fault_gives_the_reference_a_use_and_keeps_a_kl_coef_the_spec_has(tmp_path: Path) -> None:
    spec = tiny_spec()
    fault = fault_named("kill-reference")
    assert derive_spec(spec, fault, tmp_path, 8).algorithm.kl_coef == 0.01
    with_kl = dataclasses.replace(spec, algorithm=dataclasses.replace(spec.algorithm, kl_coef=0.2))
    assert derive_spec(with_kl, fault, tmp_path, 8).algorithm.kl_coef == 0.2


def test_a_spec_the_fault_cannot_be_applied_to_is_refused_naming_the_fault(tmp_path: Path) -> None:
    spec = tiny_spec()
    # One trainer GPU: a second trainer rank does not fit.
    trainer = dataclasses.replace(spec.cluster.trainer, nodes=1, gpus_per_node=1)
    spec = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, trainer=trainer))
    fault = fault_named("kill-trainer-rank")
    with pytest.raises(ValueError, match="(?s)fault kill-trainer-rank .*--only.*train.num_processes = 2: must be <="):
        checked_spec_text(derive_spec(spec, fault, tmp_path, 8), fault)


def test_unknown_fault_names_the_faults() -> None:
    with pytest.raises(ValueError, match="kill-engine, kill-actor-fwd"):
        fault_named("kill-everything")


# -- verdicts ----------------------------------------------------------------------------------


def records(*steps_seen: tuple[int, float]) -> list[StepRecord]:
    return [StepRecord(seen, step, {"step": step}) for step, seen in steps_seen]


def test_recovery_is_the_first_record_after_the_injection_not_of_the_step_in_flight() -> None:
    timeline = records((3, 10.0), (4, 11.0), (5, 19.0), (6, 20.0))
    # Injected at 10.5 after step 3: step 4 was in flight, its record may not need the role.
    injection = Injection(injected=True, injected_at=10.5, first_after=1, in_flight=4)
    assert time_to_recover(injection, timeline) == pytest.approx(8.5)


def test_after_a_rerun_its_first_record_is_the_recovery_even_a_step_trained_before() -> None:
    # Killed at 10.5 after step 3; the rerun resumes from checkpoint 2 and records step 3 again.
    timeline = records((3, 10.0), (3, 40.0), (4, 41.0))
    injection = Injection(injected=True, rerun=True, injected_at=10.5, first_after=1, in_flight=None)
    assert time_to_recover(injection, timeline) == pytest.approx(29.5)


def test_no_recovery_time_without_a_record_after_the_injection_or_without_an_injection() -> None:
    timeline = records((3, 10.0), (4, 11.0))
    assert time_to_recover(Injection(injected=True, injected_at=10.5, first_after=1, in_flight=4), timeline) is None
    assert time_to_recover(Injection(), timeline) is None


def test_restart_kind_says_what_brought_the_run_back() -> None:
    assert restart_kind(False, {"in_place": 1, "global": 0, "events": []}) == "in place"
    assert restart_kind(False, {"in_place": 2, "global": 1, "events": []}) == "global"
    assert restart_kind(True, None) == "rerun"
    assert restart_kind(True, {"in_place": 0, "global": 1}) == "global, rerun"
    assert restart_kind(False, {"in_place": 0, "global": 0}) == "none"
    assert restart_kind(False, None) == "none"


def summary(end_step: int = 8, start_step: int = 0, samples: int = 256, **more: object) -> dict[str, object]:
    return {"end_step": end_step, "start_step": start_step, "samples_trained": samples, **more}


def injected(**fields: object) -> Injection:
    return Injection(**{"injected": True, "exit_codes": [0], "injected_at": 1.0, **fields})  # type: ignore[arg-type]


def test_a_run_that_finished_with_every_sample_once_is_recovered() -> None:
    health = {"in_place": 1, "global": 0, "events": []}
    row = judge(fault_named("kill-reference"), injected(), 8, summary(health=health), (0, 0), 2.5)
    assert row == FaultRow("kill-reference", True, True, "in place", 2.5, 256, 0, 0, "")


@pytest.mark.parametrize(("case", "expected"), [
    ({"injection": injected(exit_codes=[1], last_log_line="RoleDiedError: reference died")},
     "the run failed (exit 1): RoleDiedError: reference died"),
    ({"summary": summary(end_step=5)}, "the run ended at step 5 of 8"),
    ({"summary": None}, "the last run wrote no summary.json"),
    ({"counts": (3, 0)}, "exactly-once check: 3 duplicated, 0 lost"),
    ({"counts": (0, 32)}, "exactly-once check: 0 duplicated, 32 lost"),
    ({"counts": "no trajectory archive in /x"}, "no exactly-once check: no trajectory archive in /x"),
    ({"injection": injected(rerun=True, expect_start_step=2), "summary": summary(start_step=4)},
     "the rerun started from step 4, not from the checkpoint before the damaged one (step 2)"),
    ({"injection": Injection(exit_codes=[0])}, "the fault was not injected"),
    ({"injection": Injection(exit_codes=[None], problems=["timed out after 300 s waiting for step 3"])},
     "timed out after 300 s waiting for step 3"),
])
def test_each_failure_makes_the_row_not_recovered_and_says_why(case: dict[str, object], expected: str) -> None:
    args: dict[str, object] = {"injection": injected(), "summary": summary(), "counts": (0, 0)}
    args.update(case)
    row = judge(fault_named("kill-driver"), args["injection"], 8, args["summary"],  # type: ignore[arg-type]
                args["counts"], None)  # type: ignore[arg-type]
    assert row.ran and not row.recovered
    assert row.note.startswith(expected), row.note


def test_a_fault_that_could_not_be_tried_is_not_run_and_not_counted() -> None:
    row = judge(fault_named("disk-full"), Injection(not_run="not run (needs root to mount a small file system)"),
                8, None, "no archive", None)
    assert (row.ran, row.recovered, row.restart) == (False, False, "-")
    assert row.note == "not run (needs root to mount a small file system)"


# -- the table ---------------------------------------------------------------------------------


def row(name: str, recovered: bool = True, ran: bool = True, note: str = "", lost: int | None = 0) -> FaultRow:
    return FaultRow(name, ran, recovered, "in place" if ran else "-", 3.25 if ran else None,
                    256 if ran else None, 0 if ran else None, lost if ran else None, note)


def test_table_has_fixed_columns_a_line_per_fault_and_the_notes() -> None:
    rows = [row("kill-engine"), row("kill-driver", False, note="the run failed (exit 1): boom", lost=32),
            row("disk-full", False, False, "not run (needs root to mount a small file system)")]
    lines = format_table(rows)
    header, *body = lines[:4]
    assert header.split() == ["fault", "recovered", "restart", "recover", "s", "samples", "duplicated", "lost"]
    assert body[0].split() == ["kill-engine", "yes", "in", "place", "3.2", "256", "0", "0"]
    assert body[1].split()[:2] == ["kill-driver", "NO"] and body[1].endswith(" 32")
    assert body[2].split() == ["disk-full", "not", "run", "-", "-", "-", "-", "-"]
    ends = {len(line) for line in [header, body[0], body[1]]}
    assert len(ends) == 1  # right-aligned columns: every full line ends at the same place
    assert lines[4:] == ["notes:", "  kill-driver: the run failed (exit 1): boom",
                         "  disk-full: not run (needs root to mount a small file system)"]


def test_last_line_counts_the_faults_that_ran_and_says_how_many_did_not() -> None:
    assert last_line([row("a"), row("b")]) == "faults survived: 2/2, samples lost 0, duplicated 0"
    rows = [row("a"), row("b", False, lost=32), row("c", False, False)]
    assert last_line(rows) == "faults survived: 1/2 (1 not run), samples lost 32, duplicated 0"


def test_the_suite_passes_only_when_every_fault_that_ran_recovered_and_one_ran() -> None:
    assert suite_ok([row("a"), row("b", False, False)])
    assert not suite_ok([row("a"), row("b", False)])
    assert not suite_ok([row("b", False, False)])


# -- faults in one run (relax_hpc/faults/chain.py) ---------------------------------------


def test_faults_in_one_run_go_in_the_fixed_order_and_disk_full_gets_a_run_of_its_own() -> None:
    from relax_hpc.faults.chain import ONE_RUN_ORDER, split_for_one_run

    asked = [fault_named(n) for n in ("corrupt-checkpoint", "disk-full", "kill-reference", "kill-reference-3x")]
    chained, alone = split_for_one_run(asked)
    # The three-kill fault first: a Reference killed before it would make its first kill the third failure.
    assert [f.name for f in chained] == ["kill-reference-3x", "kill-reference", "corrupt-checkpoint"]
    assert [f.name for f in alone] == ["disk-full"]
    assert sorted(ONE_RUN_ORDER) == sorted(n for n in FAULT_NAMES if n != "disk-full")


def test_a_run_of_several_faults_has_every_role_they_need_and_room_for_each(tmp_path: Path) -> None:
    from relax_hpc.faults.chain import FAULT_GAP, one_run_steps

    faults = [fault_named(n) for n in ("kill-engine", "kill-reference", "kill-actor-fwd", "kill-trainer-rank")]
    derived = parse_spec(checked_spec_text(derive_spec(tiny_spec(), faults, tmp_path, 15), faults))
    assert (derived.rollout.num_engines, derived.train.reference_role, derived.train.actor_fwd_role,
            derived.train.num_processes) == (2, True, True, 2)
    assert derived.job.name.endswith("-in-one-run") and derived.train.steps == 15
    # The first fault after step 3, each next FAULT_GAP steps later, the last one's recovery after it.
    assert one_run_steps(8, 2) == 3 + FAULT_GAP * 3 + 2 and one_run_steps(40, 2) == 40


def test_what_each_fault_of_one_run_cost_is_read_from_the_restart_counters_around_it() -> None:
    from relax_hpc.faults.chain import restart_between

    def record(step: int, in_place: int, global_: int) -> StepRecord:
        return StepRecord(float(step), step, {"health/in_place_restarts": in_place, "health/global_restarts": global_})

    timeline = [record(3, 0, 0), record(4, 1, 0), record(5, 2, 0), record(5, 2, 1), record(6, 2, 1),
                record(7, 3, 1), record(8, 3, 1)]
    assert restart_between(timeline, 0, 4) == "global"  # two in place, then a global restart
    assert restart_between(timeline, 4, 6) == "in place"
    assert restart_between(timeline, 5, 6) == "none"
    assert restart_between(timeline, 6, 6) == "none"  # no record after the fault yet


def test_faults_that_shared_a_run_count_its_lost_samples_once() -> None:
    shared = [dataclasses.replace(row(n, False, lost=32), job_dir="/out/in-one-run") for n in ("a", "b")]
    alone = dataclasses.replace(row("c", False, lost=8), job_dir="/out/c")
    assert last_line([*shared, alone]) == "faults survived: 0/3, samples lost 40, duplicated 0"


# -- job directories ---------------------------------------------------------------------------


def test_a_fault_directory_of_an_earlier_suite_is_replaced_anything_else_refused(tmp_path: Path) -> None:
    earlier = tmp_path / "kill-driver"
    earlier.mkdir()
    (earlier / FAULT_SPEC).write_text("")
    (earlier / "metrics.jsonl").write_text('{"step": 1}\n')
    assert fresh_job_dir(earlier) == earlier and list(earlier.iterdir()) == []
    theirs = tmp_path / "results"
    theirs.mkdir()
    (theirs / "precious.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a fault run's directory"):
        fresh_job_dir(theirs)
    assert (theirs / "precious.txt").read_text() == "keep"


# -- the metrics tail --------------------------------------------------------------------------


def test_metrics_tail_reads_records_as_they_are_appended_and_waits_for_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    clock = iter([1.0, 2.0, 3.0, 4.0])
    tail = MetricsTail(path, clock=lambda: next(clock))
    assert tail.poll() == [] and tail.last_step() == 0  # no file yet
    with path.open("a") as f:
        f.write(json.dumps({"step": 1, "reward/mean": 0.1}) + "\n" + '{"step": 2, "ckpt/save_')
        f.flush()
        assert [(r.step, r.seen) for r in tail.poll()] == [(1, 1.0)]
        f.write('failures": 1.0}\n' + json.dumps({"step": 3}) + "\n")
        f.flush()
        assert [(r.step, r.seen) for r in tail.poll()] == [(2, 2.0), (3, 2.0)]
        f.write(json.dumps({"step": 2}) + "\n")  # a resumed run goes back to its checkpoint
    assert [r.step for r in tail.poll()] == [2]
    assert tail.last_step() == 2 and [r.step for r in tail.records] == [1, 2, 3, 2]
    assert tail.max_scalar("ckpt/save_failures") == 1.0 and tail.max_scalar("absent") == 0.0


# -- the run's processes -----------------------------------------------------------------------

# A driver with a child in a process group of its own, as Ray's workers are.
DRIVER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=os.setpgrp)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_kill_all_ends_the_driver_and_children_in_other_process_groups_and_nothing_else(tmp_path: Path) -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        run = JobProcess([sys.executable, "-c", DRIVER], tmp_path / "log", os.environ)
        deadline = time.monotonic() + 60
        while len(run.members()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        members = run.members()
        assert run.pid in members and len(members) == 2
        child = next(pid for pid in members if pid != run.pid)
        assert os.getpgid(child) != os.getpgid(run.pid)  # a killpg of the driver's group misses it
        assert not run.owns(os.getpid()) and not run.owns(bystander.pid)
        assert run.kill_all() == []
        assert run.members() == [] and run.exit_code() == -signal.SIGKILL
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_a_stopped_process_is_killed_too(tmp_path: Path) -> None:
    run = JobProcess([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "log", os.environ)
    os.kill(run.pid, signal.SIGSTOP)
    assert run.kill_all() == [] and run.exit_code() == -signal.SIGKILL


def test_log_tail_quotes_the_last_error_line_else_the_last_line(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text("starting\nTraceback ...\nrelax_hpc.roles.errors.RestartsExhausted: reference died\n\n"
                   "(raylet) A worker died or was killed while executing a task\n")
    assert log_tail(log) == "relax_hpc.roles.errors.RestartsExhausted: reference died"
    log.write_text("starting\nrelax-hpc run: no model at /m; set [model] path\n")
    assert log_tail(log) == "relax-hpc run: no model at /m; set [model] path"
    log.write_text("starting\nstill going\n")
    assert log_tail(log) == "still going"
    assert log_tail(tmp_path / "absent") == ""


# -- the file-system faults --------------------------------------------------------------------


def test_a_corrupted_newest_checkpoint_is_skipped_for_the_one_before(tmp_path: Path) -> None:
    import torch

    from relax_hpc.ckpt import CheckpointManager, ResumeState

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (2, 4):
        manager.save(step, model, optimizer, ResumeState(step, step, {}, step * 10))
    assert newest_and_previous(tmp_path) == (4, 2)
    damaged = corrupt_checkpoint(tmp_path / "step_4")
    assert damaged.suffix == ".distcp"
    state = manager.load_latest(model, optimizer)
    assert state is not None and state.step == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a tmpfs")
def test_small_filesystem_fills_up_frees_and_is_unmounted(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    with SmallFilesystem(root, 4 << 20) as disk:
        assert os.path.ismount(root) and (root.stat().st_mode & 0o777) == 0o700
        assert disk.fill() > 3 << 20 and disk.free_bytes() == 0
        with pytest.raises(OSError, match="No space left"):
            (root / "step_4").write_bytes(bytes(8192))
        disk.free()
        assert not (root / BALLAST).exists() and disk.free_bytes() > 3 << 20
    assert not os.path.ismount(root)


def test_small_filesystem_holds_the_checkpoints_a_run_keeps(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(bytes(1 << 20))
    (tmp_path / "tokenizer.json").write_bytes(bytes(1 << 20))  # not weights
    assert small_fs_bytes(tmp_path, keep_last=2) == 4 * 6 * (1 << 20) + (16 << 20)


# -- the command -------------------------------------------------------------------------------


def relax(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "relax_hpc.cli.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_faults_help_lists_every_fault() -> None:
    result = relax("faults", "--help")
    assert result.returncode == 0
    for fault in FAULTS:
        assert f"  {fault.name}" in result.stdout
    assert "--in-one-run" in result.stdout


def test_faults_refuses_too_few_steps_and_unknown_faults(tmp_path: Path) -> None:
    result = relax("faults", "tiny_local", "--steps", "4", "--out", str(tmp_path))
    assert result.returncode == 2 and "--steps 4: the suite needs at least 6" in result.stderr
    result = relax("faults", "tiny_local", "--only", "kill-everything")
    assert result.returncode == 2 and "invalid choice: 'kill-everything'" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_fault_suite_groups_cover_every_fault_once() -> None:
    from fault_suite import GROUPS

    grouped = [fault for faults in GROUPS.values() for fault in faults]
    assert sorted(grouped) == sorted(FAULT_NAMES) and len(grouped) == len(set(grouped))
