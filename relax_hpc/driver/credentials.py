"""The job secret in the driver's environment, for the length of one run.

    with job_secret_env(job_dir, joining=bool(ray_address)):
        ...                     # start Ray and the roles: they all find the secret by path

A run inside a submitted job (``--ray-address``) uses the secret `relax-hpc submit` wrote
(RELAX_HPC_SECRET_FILE, set by the job script, which also turned Ray's token authentication
on). A local run makes a fresh secret for this run, writes it into the job directory (0600)
and turns Ray's token authentication on with a token derived from it, so `ray.init` of
anyone else on the machine is refused. docs/security.md, "Authentication".
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from relax_hpc.auth import (
    RAY_TOKEN_FILE,
    SECRET_ENV,
    JobSecret,
    JobSecretError,
    job_secret,
    write_job_secret,
)

__all__ = ["RAY_AUTH_VARS", "job_secret_env", "ray_token_auth_possible"]

log = logging.getLogger(__name__)

RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")


def ray_token_auth_possible() -> bool:
    """Whether this process can still turn Ray's token authentication on.

    Ray reads RAY_AUTH_MODE once, when it is first imported; a process that imported it with
    authentication off (a test session, a notebook) cannot talk to a token-protected cluster.
    `relax-hpc run` imports Ray only after setting the mode.
    """
    if "ray" not in sys.modules:
        return True
    from ray._raylet import AuthenticationMode, get_authentication_mode

    return bool(get_authentication_mode() == AuthenticationMode.TOKEN)


@contextlib.contextmanager
def job_secret_env(job_dir: Path, joining: bool) -> Iterator[Path]:
    """While the run lasts, this process and every process it starts authenticate with the job
    secret; yields the secret file. The environment is restored afterwards.

    ``joining``: the run joins a job's Ray cluster (`--ray-address`); the secret must already
    be named by RELAX_HPC_SECRET_FILE. Otherwise a fresh per-run secret is written into
    ``job_dir``.
    """
    if joining:
        if SECRET_ENV not in os.environ:
            raise JobSecretError(
                f"--ray-address joins a job's Ray cluster, which needs that job's secret: set {SECRET_ENV} "
                "to its JOBDIR/.secret (the job script does), or drop --ray-address for a local run"
            )
        job_secret()  # a missing, unreadable or world-readable file stops the run here, named
        yield Path(os.environ[SECRET_ENV])
        return
    path = write_job_secret(job_dir, JobSecret.generate())
    saved = {name: os.environ.get(name) for name in (SECRET_ENV, *RAY_AUTH_VARS)}
    os.environ[SECRET_ENV] = str(path)
    if ray_token_auth_possible():
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(job_dir / RAY_TOKEN_FILE)
        os.environ.pop("RAY_AUTH_TOKEN", None)  # it would take precedence over the file
    else:
        log.warning("Ray was imported in this process before the run, with RAY_AUTH_MODE=%s: its token "
                    "authentication stays off for this run (`relax-hpc run` turns it on)",
                    os.environ.get("RAY_AUTH_MODE", "disabled"))
    try:
        yield path
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
