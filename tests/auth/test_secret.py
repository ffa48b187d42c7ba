"""The job secret: file format and permissions, derivation, the bearer check."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from relax_hpc.auth import (
    RAY_TOKEN_FILE,
    SECRET_ENV,
    SECRET_FILE,
    JobSecret,
    JobSecretError,
    bearer_matches,
    job_secret,
    write_job_secret,
)


def test_written_files_are_owner_only_and_load_back(tmp_path: Path) -> None:
    secret = JobSecret.generate()
    path = write_job_secret(tmp_path / "job", secret)
    assert path == tmp_path / "job" / SECRET_FILE
    for name in (SECRET_FILE, RAY_TOKEN_FILE):
        assert stat.S_IMODE(os.stat(tmp_path / "job" / name).st_mode) == 0o600
    assert JobSecret.load(path) == secret
    assert (tmp_path / "job" / RAY_TOKEN_FILE).read_text().strip() == secret.token("ray")
    assert not list((tmp_path / "job").glob("*.tmp"))


def test_repr_and_str_never_show_the_key() -> None:
    secret = JobSecret(bytes(range(32)))
    assert bytes(range(32)).hex() not in repr(secret) + str(secret)
    assert "hidden" in repr(secret)


def test_derived_values_differ_by_purpose_and_by_secret() -> None:
    a, b = JobSecret(b"\x01" * 32), JobSecret(b"\x02" * 32)
    assert a.derive("queue/server") != a.derive("queue/client")
    assert a.derive("queue/server") != b.derive("queue/server")
    assert a.derive("x") == JobSecret(b"\x01" * 32).derive("x")  # deterministic: every process agrees
    assert len(a.token("ray")) == 64 and a.token("ray") != a.hex()
    assert a.store_prefix("trainer").startswith("trainer/") and a.store_prefix("trainer") != b.store_prefix("trainer")
    assert a.store_prefix("trainer") != a.store_prefix("weights")


def test_hmac_derivation_matches_a_hand_computed_value() -> None:
    import hashlib
    import hmac

    key = bytes(32)
    want = hmac.new(key, b"relax-hpc/ray", hashlib.sha256).hexdigest()
    assert JobSecret(key).token("ray") == want


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = write_job_secret(tmp_path, JobSecret.generate())
    os.chmod(path, mode)
    with pytest.raises(JobSecretError, match="chmod 600"):
        JobSecret.load(path)


@pytest.mark.parametrize("text", ["", "zz" * 32, "ab" * 31, "ab" * 33])
def test_a_malformed_file_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / SECRET_FILE
    path.write_text(text)
    os.chmod(path, 0o600)
    with pytest.raises(JobSecretError, match="64 hex digits"):
        JobSecret.load(path)


def test_missing_file_and_missing_env_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(JobSecretError, match="does not exist.*resubmit"):
        JobSecret.load(tmp_path / "nope")
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(JobSecretError, match=SECRET_ENV):
        job_secret()


def test_job_secret_follows_the_env_and_a_rewritten_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = JobSecret.generate()
    monkeypatch.setenv(SECRET_ENV, str(write_job_secret(tmp_path, first)))
    assert job_secret() == first
    second = JobSecret.generate()
    write_job_secret(tmp_path, second)
    os.utime(tmp_path / SECRET_FILE, ns=(1, 1))  # a new mtime even on a coarse-clock filesystem
    assert job_secret() == second


def test_bearer_matches() -> None:
    token = JobSecret(b"\x03" * 32).token("engine-http")
    assert bearer_matches(f"Bearer {token}", token)
    assert bearer_matches(f"bearer  {token} ", token)
    assert not bearer_matches(None, token)
    assert not bearer_matches("", token)
    assert not bearer_matches(token, token)  # no scheme
    assert not bearer_matches(f"Basic {token}", token)
    assert not bearer_matches(f"Bearer {token[:-1]}0" if token[-1] != "0" else f"Bearer {token[:-1]}1", token)
    assert not bearer_matches("Bearer ", token)


def test_wrong_length_key_is_refused() -> None:
    with pytest.raises(JobSecretError, match="32 bytes"):
        JobSecret(b"short")
