"""The job secret and what is derived from it (docs/security.md, "Authentication")."""

from relax_hpc.auth.secret import (
    RAY_TOKEN_FILE,
    SECRET_ENV,
    SECRET_FILE,
    JobSecret,
    JobSecretError,
    bearer_matches,
    job_secret,
    write_job_secret,
    write_private_text,
)

__all__ = [
    "RAY_TOKEN_FILE",
    "SECRET_ENV",
    "SECRET_FILE",
    "JobSecret",
    "JobSecretError",
    "bearer_matches",
    "job_secret",
    "write_job_secret",
    "write_private_text",
]
