"""Shared fixtures: one tiny Qwen3 model directory per test session (built locally, no downloads)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from relax_hpc.models.tiny import write_tiny_model

# Ray enables token auth when ~/.ray/auth_token exists; the tests start their own local clusters
# without one, also when pytest is run directly rather than through tools/run-tests.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Every listener of a job requires the job secret (docs/security.md, "Authentication"); roles
# started by a test, and the Ray workers they run in, find it through this variable.
if "RELAX_HPC_SECRET_FILE" not in os.environ:
    from relax_hpc.auth import JobSecret, write_job_secret

    os.environ["RELAX_HPC_SECRET_FILE"] = str(
        write_job_secret(Path(tempfile.mkdtemp(prefix="relax-test-secret-")), JobSecret.generate())
    )


# The tiny model's matrices are far too small to gain from intra-op threads, and on a shared,
# oversubscribed CPU a second OpenMP thread makes each matmul wait milliseconds for a core.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Written once per session; tests/driver overrides it with the seed of the embedded default.
    path = tmp_path_factory.getbasetemp() / "tiny-model-seed0"
    if not path.exists():
        write_tiny_model(path, seed=0)
    return path


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv with the relax-hpc wheel installed: (its bin dir, the environment to run it in)."""
    from wheel_venv import build_wheel_venv

    return build_wheel_venv(tmp_path_factory.mktemp("wheel"))
