"""The job directory: one run at a time (a flock on JOBDIR/.lock) and owner-only files.

A real holder of the lock runs in another process, as a first `relax-hpc run` would; the second
run is the real `run_job` / CLI.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from e2e_helpers import REPO, tiny_spec_text
from relax_hpc.ckpt import UnsafeCheckpointError
from relax_hpc.cli.main import main
from relax_hpc.driver import run as run_module
from relax_hpc.driver.jobdir import LOCK_FILE, JobDirBusyError, JobDirLock
from relax_hpc.driver.run import prepare_job_dir, run_job
from relax_hpc.spec import parse_spec

HOLDER = """
import sys
from pathlib import Path
from relax_hpc.driver.jobdir import JobDirLock
job = Path(sys.argv[1])
lock = JobDirLock(job)
lock.acquire()
(job / "checkpoints").mkdir(mode=0o700)
(job / "checkpoints" / "tmp_step_3").mkdir(mode=0o700)  # its save in progress
print("holding", flush=True)
sys.stdin.read()  # until the test closes stdin (or kills this process)
lock.release()
"""


@contextmanager
def lock_holder(job: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding ``job``'s lock, as a first run would."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(job)], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "holding\n"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.timeout(120)
def test_second_run_is_refused_while_another_holds_the_directory(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job"
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(tiny_spec_text(tiny_model_dir, job, steps=1, save_interval=1))
    with lock_holder(job) as holder:
        who = f"pid {holder.pid} on host {socket.gethostname()}"
        with pytest.raises(JobDirBusyError, match=f"job directory {job} is in use by another relax-hpc run "
                                                 f"\\({who}, started "):
            run_job(parse_spec(spec_path.read_text()), in_process=True, progress=False)

        assert main(["run", str(spec_path), "--in-process", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and who in err
        assert err.rstrip().endswith("wait for it to finish (or stop it), or set [job] output_dir "
                                     "to another directory")
        # Neither refused run touched the directory: the first run's save is still in progress.
        assert (job / "checkpoints" / "tmp_step_3").is_dir()
        assert not (job / "spec.toml").exists()

        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    # A killed holder leaves its .lock behind, naming it; that does not block the next run.
    assert json.loads((job / LOCK_FILE).read_text())["pid"] == holder.pid
    with JobDirLock(job):
        assert json.loads((job / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert (job / LOCK_FILE).read_text() == ""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_after_the_holder_ends_a_run_succeeds_with_owner_only_files(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    job = tmp_path / "job"
    spec = parse_spec(tiny_spec_text(tiny_model_dir, job, steps=1, save_interval=1))
    old_umask = os.umask(0o002)  # a group-shared cluster's umask: our files stay private anyway
    try:
        with lock_holder(job) as holder:
            with pytest.raises(JobDirBusyError, match=f"pid {holder.pid}"):
                run_job(spec, in_process=True, progress=False)
            assert holder.stdin is not None
            holder.stdin.close()  # the first run completes
            assert holder.wait(30) == 0
        report = run_job(spec, in_process=True, progress=False)
    finally:
        os.umask(old_umask)

    assert report.result.end_step == 1
    assert (job / LOCK_FILE).read_text() == ""  # released
    assert mode(job) == 0o700  # created by the first holder
    for name in ("spec.toml", "summary.json", "metrics.jsonl", "reward_curve.png", LOCK_FILE,
                 "checkpoints/latest", "checkpoints/step_1/.metadata", "checkpoints/step_1/resume.json"):
        assert mode(job / name) == 0o600, name
    for name in ("checkpoints", "checkpoints/step_1", "tensorboard"):
        assert mode(job / name) == 0o700, name
    assert not (job / "checkpoints" / "tmp_step_3").exists()  # the dead run's leftover, pruned

    # Resuming refuses a checkpoint others could have changed, and still releases the lock.
    (job / "checkpoints" / "step_1" / ".metadata").chmod(0o664)
    more = parse_spec(tiny_spec_text(tiny_model_dir, job, steps=2, save_interval=1))
    with pytest.raises(UnsafeCheckpointError, match=r"step_1/\.metadata \(mode 0664: writable by group\)"):
        run_job(more, in_process=True, progress=False)
    assert (job / LOCK_FILE).read_text() == ""


def test_lock_is_released_when_the_run_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    def fail(*_args: object) -> None:
        raise RuntimeError("the roles failed to start")

    monkeypatch.setattr(run_module, "run_locked", fail)
    spec = parse_spec(tiny_spec_text(tiny_model_dir, tmp_path / "job", steps=1))
    with pytest.raises(RuntimeError, match="roles failed"):
        run_job(spec, in_process=True, progress=False)
    with JobDirLock(tmp_path / "job"):  # free again
        pass


def test_existing_job_dir_keeps_its_mode_and_new_files_are_private(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir(mode=0o755)
    spec = parse_spec(tiny_spec_text(tmp_path / "model", job, steps=1))
    old_umask = os.umask(0o002)
    try:
        with JobDirLock(job):
            prepare_job_dir(spec)
    finally:
        os.umask(old_umask)
    assert mode(job) == 0o755  # the user's directory: neither widened nor narrowed
    assert {n: mode(job / n) for n in (LOCK_FILE, "spec.toml", "metrics.jsonl")} == {
        LOCK_FILE: 0o600, "spec.toml": 0o600, "metrics.jsonl": 0o600}
    assert mode(job / "checkpoints") == 0o700 and mode(job / "tensorboard") == 0o700

    fresh = tmp_path / "runs" / "new"
    with JobDirLock(fresh):
        pass
    assert mode(fresh) == 0o700 and mode(fresh.parent) != 0o700  # only the job dir itself


def test_holder_that_has_not_written_its_pid_yet(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    fd = os.open(job / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file: conflicts in-process too
        with pytest.raises(JobDirBusyError, match="its pid and host are not written yet"):
            JobDirLock(job).acquire()
    finally:
        os.close(fd)


def test_filesystem_without_flock_warns_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_locks(_fd: int, _op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING), JobDirLock(tmp_path / "job"):
        pass
    assert "does not support flock, so nothing stops a second run" in caplog.text
