"""JOBDIR/status.json (RunStatus) and the summary `relax-hpc status JOBDIR` prints (status_lines)."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from relax_hpc.ops import run_status
from relax_hpc.ops.health import HeartbeatWriter, heartbeat_path
from relax_hpc.ops.run_status import STATUS_FILE, RunStatus, read_status, status_lines


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _beat(job_dir: Path, role: str, doing: str = "", mtime: float | None = None) -> None:
    heartbeat_path(job_dir, role).parent.mkdir(exist_ok=True)
    HeartbeatWriter(heartbeat_path(job_dir, role), role, 1.0, lambda: doing).beat()
    if mtime is not None:
        os.utime(heartbeat_path(job_dir, role), (mtime, mtime))


def _role_line(lines: list[str], role: str) -> str:
    found = [line for line in lines if line.strip().startswith(role + " ")]
    assert len(found) == 1, lines
    return found[0]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --- the writer ---------------------------------------------------------------------------------


def test_a_new_status_says_starting_with_the_driver_pid_and_host_in_an_owner_only_file(tmp_path: Path) -> None:
    RunStatus(tmp_path, "tiny", total_steps=40, clock=Clock(1000.0))
    path = tmp_path / STATUS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = read_status(tmp_path)
    assert data is not None
    assert (data["state"], data["job"], data["total_steps"], data["step"]) == ("starting", "tiny", 40, None)
    assert data["driver"] == {"pid": os.getpid(), "host": socket.gethostname(), "started": 1000.0}
    assert [p.name for p in tmp_path.iterdir()] == [STATUS_FILE]  # no temp file left beside it


def test_every_setter_is_in_the_file_at_once(tmp_path: Path) -> None:
    clock = Clock(1000.0)
    status = RunStatus(tmp_path, "tiny", total_steps=40, clock=clock)
    status.set_state("running", "resumed from step_4")
    clock.now = 1010.0
    status.on_step(5, {"reward/mean": 0.25, "time/step_s": 2.0, "other": 1.0}, samples_trained=256)
    roles = {"rollout": {"state": "running", "restarts": 0}, "reference": {"state": "restarting", "restarts": 1}}
    status.set_roles(roles)
    engines = [{"id": 0, "address": "local", "state": "active", "weight_version": 5, "samples": 256,
                "job": None, "protected": True, "alive": True}]
    status.set_engines(engines)
    status.set_restarts(1, 2)
    clock.now = 1020.0
    status.add_event("reference died: restarted in place")
    status.set_checkpoint(str(tmp_path / "checkpoints" / "step_4"))

    data = read_status(tmp_path)
    assert data is not None
    assert (data["state"], data["note"]) == ("running", "resumed from step_4")
    assert (data["step"], data["reward"], data["step_s"], data["step_time"]) == (5, 0.25, 2.0, 1010.0)
    assert data["samples_per_s"] == 128.0  # 256 samples / 2.0 s
    assert data["roles"] == roles and data["engines"] == engines
    assert data["restarts"] == {"in_place": 1, "global": 2}
    assert data["events"] == [{"time": 1020.0, "line": "reference died: restarted in place"}]
    assert data["checkpoint"] == str(tmp_path / "checkpoints" / "step_4")
    assert data["updated"] == 1020.0
    assert stat.S_IMODE((tmp_path / STATUS_FILE).stat().st_mode) == 0o600
    status.set_checkpoint(None)
    assert read_status(tmp_path)["checkpoint"] is None  # type: ignore[index]


def test_samples_per_second_is_the_step_s_and_the_last_ten_steps(tmp_path: Path) -> None:
    status = RunStatus(tmp_path, "tiny", total_steps=40)
    # Steps 1 and 2 take 4 s for 100 samples; steps 3..12 take 1 s for 100. After step 12 the
    # last ten steps are 3..12: 1000 samples in 10 s = 100/s (steps 1-2 would pull it to 1200/18).
    for step in range(1, 13):
        status.on_step(step, {"reward/mean": 0.0, "time/step_s": 4.0 if step <= 2 else 1.0}, 100)
    data = read_status(tmp_path)
    assert data is not None
    assert (data["samples_per_s"], data["samples_per_s_mean"]) == (100.0, 100.0)
    assert data["samples_since_start"] == 1200
    status = RunStatus(tmp_path, "tiny", total_steps=40)
    status.on_step(1, {"reward/mean": 0.0, "time/step_s": 4.0}, 100)
    status.on_step(2, {"reward/mean": 0.0, "time/step_s": 1.0}, 100)
    assert read_status(tmp_path)["samples_per_s_mean"] == 40.0  # type: ignore[index]  # 200 / 5 s


def test_a_non_finite_reward_is_written_as_null(tmp_path: Path) -> None:
    status = RunStatus(tmp_path, "tiny", total_steps=4)
    status.on_step(1, {"reward/mean": float("nan"), "time/step_s": 0.0}, 10)
    data = json.loads((tmp_path / STATUS_FILE).read_text())  # strict JSON: no NaN in it
    assert data["reward"] is None and data["samples_per_s"] is None and data["step"] == 1


def test_only_the_last_fifty_events_are_kept_each_with_its_time(tmp_path: Path) -> None:
    clock = Clock(0.0)
    status = RunStatus(tmp_path, "tiny", total_steps=4, clock=clock)
    for i in range(55):
        clock.now = float(i)
        status.add_event(f"event {i}")
    events = read_status(tmp_path)["events"]  # type: ignore[index]
    assert len(events) == 50
    assert events[0] == {"time": 5.0, "line": "event 5"} and events[-1] == {"time": 54.0, "line": "event 54"}


def test_an_unknown_state_is_refused_by_name(tmp_path: Path) -> None:
    status = RunStatus(tmp_path, "tiny", total_steps=4)
    with pytest.raises(ValueError, match="'runing'.*running"):
        status.set_state("runing")
    assert read_status(tmp_path)["state"] == "starting"  # type: ignore[index]


def test_a_failed_write_keeps_the_last_complete_file_and_never_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    status = RunStatus(tmp_path, "tiny", total_steps=4)
    status.set_state("running")
    before = (tmp_path / STATUS_FILE).read_text()

    def fail(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_status.os, "replace", fail)
    with caplog.at_level(logging.WARNING, logger=run_status.__name__):
        status.on_step(1, {"reward/mean": 0.5, "time/step_s": 1.0}, 8)
        status.set_state("finished")
    monkeypatch.undo()
    assert (tmp_path / STATUS_FILE).read_text() == before  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == [STATUS_FILE]  # the temp files were removed
    assert len([r for r in caplog.records if "cannot write" in r.message]) == 1  # once, not per write
    status.set_state("finished")  # the disk has room again: the next write has everything
    data = read_status(tmp_path)
    assert data is not None and (data["state"], data["step"]) == ("finished", 1)


# --- the summary --------------------------------------------------------------------------------


def test_no_status_file_says_the_run_has_not_started_or_this_is_no_job_directory(tmp_path: Path) -> None:
    lines = status_lines(tmp_path)
    assert len(lines) == 1
    assert "has not started yet, or this is not a job directory" in lines[0] and str(tmp_path) in lines[0]


def test_a_live_run_shows_progress_fresh_roles_engines_checkpoint_and_events(tmp_path: Path) -> None:
    status = RunStatus(tmp_path, "tiny", total_steps=40)
    status.set_state("running")
    status.on_step(7, {"reward/mean": 0.4321, "time/step_s": 2.0}, 256)
    status.set_roles({"rollout": {"state": "running", "restarts": 0},
                      "reference": {"state": "running", "restarts": 2}})
    status.set_engines([{"id": 0, "address": "local", "state": "active", "weight_version": 7, "samples": 1792,
                         "job": None, "protected": True, "alive": True}])
    status.set_restarts(2, 0)
    status.add_event("reference died: restarted in place")
    for role, doing in (("driver", "step 8"), ("rollout", "generating step 8"), ("trainer_rank_0", "training"),
                        ("reference", "forward step 8")):
        _beat(tmp_path, role, doing)
    (tmp_path / "checkpoints" / "step_5").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step_5\n")

    lines = status_lines(tmp_path)
    text = "\n".join(lines)
    assert lines[0] == f"run tiny  ({tmp_path})"
    assert f"running  (driver pid {os.getpid()} on this host" in text
    assert "7/40  reward 0.432  2.00 s/step  128.0 samples/s" in text
    # Roles in a fixed order: the driver, rollout, trainer ranks, the queue roles.
    order = [line.split()[0] for line in lines if line.startswith("    ") and "pid" in line]
    assert order == ["driver", "rollout", "trainer_rank_0", "reference"]
    line = _role_line(lines, "reference")
    assert "running" in line and f"pid {os.getpid()}" in line and socket.gethostname() in line
    assert "forward step 8" in line and "restarts 2" in line and "stale" not in line
    assert "engines    1, 1 active" in text and "v7" in text and "(protected)" in text
    assert f"checkpoint step_5 ({tmp_path / 'checkpoints' / 'step_5'})" in text
    assert "restarts   2 in place, 0 global" in text
    assert "reference died: restarted in place" in lines[-1]


def test_a_beat_older_than_the_specs_stale_s_shows_stale(tmp_path: Path) -> None:
    status = RunStatus(tmp_path, "tiny", total_steps=40)
    status.set_state("running")
    (tmp_path / "spec.toml").write_text("[health]\nheartbeat_s = 0.5\nstale_s = 5.0\n")
    _beat(tmp_path, "rollout", mtime=10_000.0)
    _beat(tmp_path, "trainer_rank_0", mtime=10_003.0)
    lines = status_lines(tmp_path, now=10_006.0)  # rollout silent 6 s, the trainer 3 s
    assert "(heartbeat every 0.5s, stale after 5s)" in "\n".join(lines)
    assert _role_line(lines, "rollout").split()[1] == "stale"
    assert "beat 6s ago" in _role_line(lines, "rollout")
    assert _role_line(lines, "trainer_rank_0").split()[1] == "running"


def test_without_a_spec_the_default_stale_s_applies(tmp_path: Path) -> None:
    RunStatus(tmp_path, "tiny", total_steps=40).set_state("running")
    _beat(tmp_path, "rollout", mtime=10_000.0)
    assert _role_line(status_lines(tmp_path, now=10_119.0), "rollout").split()[1] == "running"
    assert _role_line(status_lines(tmp_path, now=10_121.0), "rollout").split()[1] == "stale"


def test_a_running_status_whose_driver_is_gone_says_so(tmp_path: Path) -> None:
    RunStatus(tmp_path, "tiny", total_steps=40).set_state("running")
    data = json.loads((tmp_path / STATUS_FILE).read_text())
    pid = _dead_pid()
    data["driver"]["pid"] = pid
    (tmp_path / STATUS_FILE).write_text(json.dumps(data))
    _beat(tmp_path, "rollout", mtime=10_000.0)
    lines = status_lines(tmp_path, now=10_500.0)
    assert lines[1] == (f"  state      running (driver pid {pid} is gone: the run was killed; `relax-hpc run` "
                        "again resumes it from its newest checkpoint)")
    assert _role_line(lines, "rollout").split()[1] == "ended"  # not "stale": nothing watches it now


def test_a_driver_on_another_host_is_not_checked_here(tmp_path: Path) -> None:
    RunStatus(tmp_path, "tiny", total_steps=40).set_state("running")
    data = json.loads((tmp_path / STATUS_FILE).read_text())
    data["driver"].update(pid=_dead_pid(), host="node-that-is-not-this-one")
    (tmp_path / STATUS_FILE).write_text(json.dumps(data))
    state = status_lines(tmp_path)[1]
    assert "host node-that-is-not-this-one, not this one: not checked" in state and "gone" not in state


def test_a_finished_run_shows_its_state_and_roles_ended(tmp_path: Path) -> None:
    status = RunStatus(tmp_path, "tiny", total_steps=4)
    status.on_step(4, {"reward/mean": 0.5, "time/step_s": 1.0}, 8)
    status.set_roles({"rollout": {"state": "running", "restarts": 0}})
    status.set_state("finished", "all 4 steps")
    lines = status_lines(tmp_path)
    assert lines[1].startswith("  state      finished at ") and lines[1].endswith(" ago): all 4 steps")
    assert _role_line(lines, "rollout").split()[1] == "ended"
    assert "checkpoint none yet" in "\n".join(lines)


@pytest.mark.parametrize(("latest", "dirs", "expected"), [
    ("step_4\n", [4, 6], "step_4"),   # the pointer goes first (a rollback), as when the run resumes
    (None, [4, 6, 10], "step_10"),    # no pointer: the newest complete one
    ("step_9\n", [4, 6], "step_6"),   # a pointer to nothing: the newest
    ("garbage", [2], "step_2"),
])
def test_the_newest_checkpoint_is_the_one_a_resume_loads(tmp_path: Path, latest: str | None, dirs: list[int],
                                                         expected: str) -> None:
    root = tmp_path / "checkpoints"
    for step in dirs:
        (root / f"step_{step}").mkdir(parents=True)
    (root / "tmp_step_99").mkdir()  # being written: never counted
    if latest is not None:
        (root / "latest").write_text(latest)
    RunStatus(tmp_path, "tiny", total_steps=40)
    assert f"checkpoint {expected} ({root / expected})" in "\n".join(status_lines(tmp_path))


def test_heartbeats_without_a_status_file_still_show_the_roles_and_whether_the_driver_lives(
        tmp_path: Path) -> None:
    _beat(tmp_path, "driver", mtime=10_000.0)
    _beat(tmp_path, "rollout", "producing step 3", mtime=10_000.0)
    lines = status_lines(tmp_path, now=10_001.0)
    assert lines[1] == f"  state      unknown: no {STATUS_FILE}, only heartbeats"  # this process: alive
    assert _role_line(lines, "rollout").split()[1] == "running" and "producing step 3" in _role_line(lines, "rollout")
    record = json.loads(heartbeat_path(tmp_path, "driver").read_text())
    record["pid"] = _dead_pid()
    heartbeat_path(tmp_path, "driver").write_text(json.dumps(record))
    lines = status_lines(tmp_path, now=10_500.0)
    assert lines[1].endswith(f"driver pid {record['pid']} is gone")
    assert _role_line(lines, "rollout").split()[1] == "ended"


def test_a_role_line_names_the_slurm_node_where_the_host_name_is_shared(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", "n3")  # tools/dev-slurm: every node is this host
    _beat(tmp_path, "reference", "forward step 2")
    assert " n3 " in _role_line(status_lines(tmp_path), "reference")
