"""A checkpoint save that fails on its storage (a full disk) does not end the run.

The first tests drive `run_loop` and `CheckpointSaver` with role doubles: a failure mid-run is
warned about, counted in `ckpt/save_failures` and the loop trains on; the last save is retried
once, then fails the run with a clear error; other failures are raised as they were. One test
hands the failures through a real Ray actor, as the trainer ranks raise them. The last test fills
a real tmpfs mounted on the job's checkpoint directory during one save of an in-process run.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from ckpt_fault_helpers import (
    assert_every_sample_trained_once,
    assert_latest_is_complete,
    tiny_local_copy,
)
from test_loop_overlap import RecordedRoles

from relax_hpc.ckpt import ResumeState
from relax_hpc.ckpt.manager import CheckpointDiskFullError
from relax_hpc.driver.checkpointing import (
    CheckpointSaver,
    FinalSaveError,
    storage_failure,
)
from relax_hpc.driver.loop import LoopResult, LoopTables, StopFlag, run_loop
from relax_hpc.ops.metrics import InMemorySink, read_metrics
from relax_hpc.roles.handles import LocalRoles, RoleTimeoutError
from relax_hpc.spec import parse_spec
from relax_hpc.spec.schema import AlgorithmSpec, CheckpointSpec, TrainSpec

WARN = "relax_hpc.driver.checkpointing"


def disk_full(step: int) -> CheckpointDiskFullError:
    """As the checkpoint manager raises it (on every trainer rank)."""
    return CheckpointDiskFullError(
        f"saving checkpoint step_{step} failed: the disk holding /scratch/me/job/checkpoints is full "
        "([Errno 28] No space left on device)", "/scratch")


class FailingSaves(RecordedRoles):
    """RecordedRoles whose saves raise, in turn, the errors listed for their step."""

    def __init__(self, errors: dict[int, list[BaseException]]) -> None:
        super().__init__()
        self.errors = errors

    def save_checkpoint(self, state: ResumeState) -> str:
        path = super().save_checkpoint(state)
        if self.errors.get(state.step):
            raise self.errors[state.step].pop(0)
        return path


def loop(roles: RecordedRoles, total: int, save_interval: int = 2, stop: StopFlag | None = None,
         **kwargs: object) -> tuple[LoopResult, InMemorySink, list[tuple[int, BaseException]]]:
    sink, alerts = InMemorySink(), []
    tables = LoopTables(TrainSpec(steps=total), AlgorithmSpec(max_staleness=1),
                        CheckpointSpec(save_interval=save_interval, resume=False))
    result = run_loop(tables, roles, sink, stop or StopFlag(), **kwargs,  # type: ignore[arg-type]
                      final_save_retry_s=0.0,
                      on_save_failed=lambda step, error: alerts.append((step, error)))
    return result, sink, alerts


def saves(roles: RecordedRoles) -> list[str]:
    return [e for e in roles.events if e.startswith("checkpoint")]


def test_a_full_disk_mid_run_is_warned_counted_and_the_next_save_tries_again(
        caplog: pytest.LogCaptureFixture) -> None:
    failure = disk_full(2)
    roles = FailingSaves({2: [failure]})
    with caplog.at_level(logging.WARNING, logger=WARN):
        result, sink, alerts = loop(roles, total=6)

    assert saves(roles) == ["checkpoint 2 version 2", "checkpoint 4 version 4", "checkpoint 6 version 6"]
    assert result.end_step == 6 and not result.stopped_early
    assert result.save_failures == 1 and result.last_checkpoint == "step_6"
    # The count so far in each step's metrics: step 2's failed save shows from step 3 on.
    assert [(step, m["ckpt/save_failures"]) for step, m in sink.rows] == [
        (1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0), (5, 1.0), (6, 1.0)]
    assert alerts == [(2, failure)]
    warning = caplog.records[-1].getMessage()
    assert "saving the checkpoint of step 2 failed: saving checkpoint step_2 failed: the disk" in warning
    assert "Training goes on and the next save tries again" in warning
    assert "free space on /scratch now" in warning


def test_every_storage_errno_is_survived_and_other_failures_end_the_loop() -> None:
    io_error = OSError(errno.EIO, os.strerror(errno.EIO), "/scratch/job/checkpoints/tmp_step_2/__0_0.distcp")
    result, _, alerts = loop(FailingSaves({2: [io_error]}), total=4)
    assert result.save_failures == 1 and alerts == [(2, io_error)]

    # A trainer rank that does not answer is a TimeoutError, an OSError without an errno: not storage.
    hung = RoleTimeoutError("trainer rank 1 did not answer within 3600 s while saving the checkpoint of step 2")
    for error in (hung, ValueError("ResumeState.step=2 differs from save(step=3)")):
        roles = FailingSaves({2: [error]})
        with pytest.raises(type(error)) as info:
            loop(roles, total=4)
        assert info.value is error
        assert saves(roles) == ["checkpoint 2 version 2"]  # nothing trained past it


def test_the_last_save_is_retried_once_after_the_wait() -> None:
    roles = FailingSaves({4: [disk_full(4)]})
    result, _, alerts = loop(roles, total=4)
    assert saves(roles) == ["checkpoint 2 version 2", "checkpoint 4 version 4", "checkpoint 4 version 4"]
    assert result.last_checkpoint == "step_4" and result.save_failures == 1 and [s for s, _ in alerts] == [4]


def test_the_last_save_failing_twice_fails_the_run_and_says_what_is_lost() -> None:
    roles = FailingSaves({4: [disk_full(4), disk_full(4)]})
    with pytest.raises(FinalSaveError) as info:
        loop(roles, total=4)
    assert saves(roles) == ["checkpoint 2 version 2", "checkpoint 4 version 4", "checkpoint 4 version 4"]
    message = str(info.value)
    assert message.startswith("the checkpoint of step 4, the last of this run, could not be saved "
                              "(tried twice, 0 s apart): saving checkpoint step_4 failed: the disk")
    assert "trained after the newest complete checkpoint (step_2) are not saved; free space on /scratch" in message
    assert "[checkpoint] resume = true" in message
    assert isinstance(info.value.__cause__, CheckpointDiskFullError)


def test_the_save_on_a_stop_is_a_last_save_too() -> None:
    stop = StopFlag()

    def stop_at_3(step: int, m: dict[str, float]) -> None:
        stop.requested = stop.requested or step == 3

    # Step 4 was queued before the stop: it trains, then its save is the run's last.
    roles = FailingSaves({4: [disk_full(4), disk_full(4)]})
    with pytest.raises(FinalSaveError, match="the checkpoint of step 4, the last of this run"):
        loop(roles, total=10, save_interval=5, stop=stop, on_step=stop_at_3)
    assert saves(roles) == ["checkpoint 4 version 4", "checkpoint 4 version 4"]


class OneSave:
    """Roles with only `save_checkpoint`, failing with the errors given, in turn."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors, self.calls = list(errors), 0

    def save_checkpoint(self, state: ResumeState) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return f"step_{state.step}"


def test_the_saver_waits_before_the_retry_and_counts_every_failed_attempt() -> None:
    waits: list[float] = []
    alerts: list[int] = []
    roles = OneSave(disk_full(8), disk_full(8))
    saver = CheckpointSaver(roles, 30.0, lambda step, e: alerts.append(step),  # type: ignore[arg-type]
                            last_saved=5, sleep=waits.append)
    state = ResumeState(step=8, weight_version=8, data_cursor={}, samples_trained=0)
    with pytest.raises(FinalSaveError, match=r"tried twice, 30 s apart.*newest complete checkpoint \(step_5\)"):
        saver.save(state, is_final=lambda step: True)
    assert roles.calls == 2 and waits == [30.0] and alerts == [8, 8] and saver.failures == 2

    mid_run = CheckpointSaver(OneSave(disk_full(8)), 30.0, lambda step, e: None,  # type: ignore[arg-type]
                              sleep=waits.append)
    assert mid_run.save(state, is_final=lambda step: False) is None
    assert mid_run.failures == 1 and mid_run.last_saved is None and waits == [30.0]  # no wait mid-run
    assert mid_run.save(state, is_final=lambda step: False) == "step_8" and mid_run.last_saved == 8


class SavingRank:
    """A trainer rank on Ray whose save fails as the checkpoint manager's does."""

    def save(self, kind: str) -> str:
        if kind == "full":
            raise CheckpointDiskFullError("saving checkpoint step_2 failed: the disk holding /x is full", "/x")
        if kind == "io":
            raise OSError(errno.EIO, os.strerror(errno.EIO), "/x/tmp_step_2/__0_0.distcp")
        raise RuntimeError("the gloo collective of the save failed: Connection closed by peer")


@pytest.mark.slow
def test_a_storage_failure_is_recognized_through_ray() -> None:
    ray = pytest.importorskip("ray")
    from relax_hpc.roles.handles import get_from_roles

    # The actor's class lives in this module: its worker imports it from here.
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}})
    try:
        rank = ray.remote(SavingRank).remote()
        caught = {}
        for kind in ("full", "io", "other"):
            with pytest.raises(Exception) as info:
                get_from_roles([("trainer rank 0", rank.save.remote(kind))], "saving", 60.0)
            caught[kind] = info.value
    finally:
        ray.shutdown()
    full = storage_failure(caught["full"])
    assert type(full) is CheckpointDiskFullError  # the role's own exception, not Ray's wrapper
    assert str(full) == "saving checkpoint step_2 failed: the disk holding /x is full" and full.filesystem == "/x"
    io = storage_failure(caught["io"])
    assert isinstance(io, OSError) and io.errno == errno.EIO
    assert storage_failure(caught["other"]) is None


# -- a real full disk ----------------------------------------------------------------------------


@contextmanager
def tmpfs(mount_at: Path, size: str) -> Iterator[None]:
    """A tmpfs of `size` mounted (owner-only) at `mount_at`, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    mount_at.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount_at)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed, no privilege to mount here: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(mount_at)], check=True)


def fill(path: Path) -> None:
    """Write `path` until its filesystem is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    chunk = b"\0" * (64 << 10)
    try:
        while True:
            os.write(fd, chunk)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


def test_a_full_disk_during_one_save_loses_nothing(tiny_model_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    from relax_hpc.driver.run import run_job

    job = tmp_path / "job"
    checkpoints = job / "checkpoints"
    ballast = checkpoints / "ballast"
    real_save = LocalRoles.save_checkpoint

    def save_on_a_full_disk_at_step_2(self: LocalRoles, state: ResumeState) -> str:
        if state.step != 2:
            return real_save(self, state)
        fill(ballast)
        try:
            return real_save(self, state)
        finally:
            ballast.unlink()

    monkeypatch.setattr(LocalRoles, "save_checkpoint", save_on_a_full_disk_at_step_2)
    # A checkpoint of the tiny model is ~1.5 MB; 3 fit at once (keep_last 2 and the one written).
    with tmpfs(checkpoints, "8m"):
        with caplog.at_level(logging.WARNING):
            report = run_job(parse_spec(tiny_local_copy(tiny_model_dir, job, steps=4)), in_process=True,
                             progress=False)
        assert report.result.end_step == 4 and report.result.save_failures == 1
        failures = {int(r["step"]): r["ckpt/save_failures"] for r in read_metrics(job / "metrics.jsonl")}
        assert failures == {1: 0, 2: 0, 3: 1, 4: 1}
        warning = next(r.getMessage() for r in caplog.records if r.name == WARN)
        assert "saving the checkpoint of step 2 failed: saving checkpoint step_2 failed: the disk holding" in warning
        assert "No space left on device" in warning and f"free space on {checkpoints} now" in warning
        assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_3", "step_4"]
        assert_latest_is_complete(checkpoints, 4)

        resumed = run_job(parse_spec(tiny_local_copy(tiny_model_dir, job, steps=6)), in_process=True,
                          progress=False)
        assert (resumed.result.start_step, resumed.result.end_step, resumed.result.save_failures) == (4, 6, 0)
        assert_latest_is_complete(checkpoints, 6)
    assert_every_sample_trained_once(job, steps=6)
