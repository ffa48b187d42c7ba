"""The driver's job secret: a fresh one per local run, the submitted one when joining a job."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from relax_hpc.auth import (
    SECRET_ENV,
    JobSecret,
    JobSecretError,
    job_secret,
    write_job_secret,
)
from relax_hpc.driver.credentials import job_secret_env, ray_token_auth_possible


def test_a_local_run_gets_a_fresh_secret_and_the_env_comes_back(tmp_path: Path) -> None:
    before = dict(os.environ)
    with job_secret_env(tmp_path / "a", joining=False) as first_path:
        assert os.environ[SECRET_ENV] == str(first_path) == str(tmp_path / "a" / ".secret")
        first = job_secret()
    with job_secret_env(tmp_path / "a", joining=False):
        second = job_secret()
    assert first != second  # per run, not per directory
    assert dict(os.environ) == before


def test_joining_uses_the_submitted_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    submitted = JobSecret.generate()
    monkeypatch.setenv(SECRET_ENV, str(write_job_secret(tmp_path, submitted)))
    with job_secret_env(tmp_path / "elsewhere", joining=True) as path:
        assert path == tmp_path / ".secret" and job_secret() == submitted
    assert not (tmp_path / "elsewhere").exists()  # nothing generated


def test_joining_without_a_secret_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(JobSecretError, match="--ray-address.*JOBDIR/.secret"), job_secret_env(tmp_path, joining=True):
        pass


def test_joining_with_a_readable_secret_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_job_secret(tmp_path, JobSecret.generate())
    os.chmod(path, 0o644)
    monkeypatch.setenv(SECRET_ENV, str(path))
    with pytest.raises(JobSecretError, match="chmod 600"), job_secret_env(tmp_path, joining=True):
        pass


def test_ray_imported_without_auth_keeps_it_off_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    import ray  # noqa: F401  (this test session's Ray: authentication off, as conftest set it)

    if ray_token_auth_possible():
        pytest.skip("this session's Ray was imported with token authentication on")
    with caplog.at_level(logging.WARNING), job_secret_env(tmp_path, joining=False):
        assert os.environ["RAY_AUTH_MODE"] == "disabled"  # token mode would lock this process out
        assert job_secret() == JobSecret.load(tmp_path / ".secret")  # the rest of the job is still keyed
    assert "token authentication stays off" in caplog.text
