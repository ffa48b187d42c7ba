"""Job directories others can write are refused, and planted names do not redirect our writes:
a `.lock` symbolic link, a guessable temp name, a forged cluster.json (real files, real chmod)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from relax_hpc.ckpt.fs import atomic_write_text
from relax_hpc.driver.jobdir import LOCK_FILE, JobDirLock, UnsafePathError, make_private_dir
from relax_hpc.launch.federation import read_cluster_json, rest_endpoint


def test_group_writable_job_dir_is_refused(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    job.chmod(0o770)
    with pytest.raises(UnsafePathError, match=r"job directory .*job \(mode 0770: writable by group\).*chmod go-w"):
        JobDirLock(job).acquire()
    assert not (job / LOCK_FILE).exists()  # refused before anything is written
    logs = tmp_path / "ok" / "logs"
    logs.mkdir(parents=True)
    logs.chmod(0o777)
    with pytest.raises(UnsafePathError, match="writable by group and others"):
        make_private_dir(logs)
    job.chmod(0o750)  # readable by the group, on purpose: fine
    with JobDirLock(job):
        pass


def test_planted_lock_symlink_does_not_truncate_the_target(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    (job / LOCK_FILE).symlink_to(victim)
    with pytest.raises(UnsafePathError, match=r"\.lock: it is a symbolic link.*rm "):
        JobDirLock(job).acquire()
    assert victim.read_text() == "keep me\n"


def test_planted_temp_name_is_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    target = tmp_path / "latest"
    # The name the old writer used: .NAME.tmp<pid>, opened without O_EXCL.
    (tmp_path / f".latest.tmp{os.getpid()}").symlink_to(victim)
    atomic_write_text(target, "step_3\n")
    assert target.read_text() == "step_3\n" and victim.read_text() == "keep me\n"


def test_forged_cluster_json_is_not_trusted(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    forged = job / "cluster.json"
    forged.write_text(json.dumps({"rest_url": "http://evil:1", "secret_file": str(job / ".secret")}))
    forged.chmod(0o666)  # as one another user could have written
    with pytest.raises(UnsafePathError, match=r"cluster\.json: its mode 0666 lets others write it"):
        rest_endpoint(job)
    forged.unlink()
    elsewhere = tmp_path / "their.json"
    elsewhere.write_text(json.dumps({"rest_url": "http://evil:1"}))
    forged.symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        read_cluster_json(job)
    forged.unlink()
    forged.write_text(json.dumps({"rest_url": "http://ours:2"}))
    forged.chmod(0o600)
    assert read_cluster_json(job) == {"rest_url": "http://ours:2"}
    job.chmod(0o777)
    with pytest.raises(UnsafePathError, match="job directory"):
        read_cluster_json(job)
    job.chmod(0o700)
