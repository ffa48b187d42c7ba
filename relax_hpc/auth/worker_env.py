"""The environment of processes that run user code: the job's, less its credentials.

Reward workers (`relax_hpc.rewards.workers`) and subprocess agents (`relax_hpc.agents.subproc`)
run code that a spec or a dataset chose: a reward that executes a response's program, an agent
tool that runs a shell. The job script exports the paths of the job secret and Ray's token to
every process of the job (docs/security.md, "Authentication"); such code must not be handed
them, nor pass them on to whatever it starts. Standard library only: a subprocess agent's
worker imports this before anything else.

    env = worker_environment()          # for subprocess.Popen(env=...)
    drop_credentials_from_environ()     # inside a worker that was started with them
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# What points at the job's credentials (or is one: Ray accepts its token inline too).
CREDENTIAL_VARS: tuple[str, ...] = ("RELAX_HPC_SECRET_FILE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")


def worker_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) without CREDENTIAL_VARS."""
    source = os.environ if base is None else base
    return {name: value for name, value in source.items() if name not in CREDENTIAL_VARS}


def drop_credentials_from_environ() -> None:
    """Remove CREDENTIAL_VARS from this process's environment, and so from its children's."""
    for name in CREDENTIAL_VARS:
        os.environ.pop(name, None)
