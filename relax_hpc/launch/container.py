"""The command prefix that runs a component's processes in its Apptainer image (pure).

With ``[container] image`` set, every srun step and the driver run as
``apptainer exec [--nv] --bind ... [--env-file "$JOB_DIR/container.env"] IMAGE <command>``;
``--nv`` (the host's NVIDIA driver inside the container) only for components with GPUs. The
job directory and the submit directory are always bound, so checkpoints, logs and relative
paths of the spec work inside. Without an image the prefix is empty and commands run on the host.

``[container] env`` values may be secrets (a W&B key, a hub token), so they never appear on a
command line (``ps`` shows it to every user of the node) or in the batch script: `relax-hpc
submit` writes them into JOBDIR/container.env, owner-only, with :func:`env_file_text`, and the
prefix names that file (``apptainer exec --env-file``).
"""

from __future__ import annotations

import shlex

from relax_hpc.spec import ContainerSpec

__all__ = ["ALWAYS_BOUND", "ENV_FILE", "container_prefix", "env_file_text", "render_wrapper"]

# Shell words (expanded inside the batch script) bound into every container.
ALWAYS_BOUND = ('"$JOB_DIR"', '"$SLURM_SUBMIT_DIR"')
# The [container] env assignments, in the job directory (written by submit, mode 0600).
ENV_FILE = "container.env"


def container_prefix(container: ContainerSpec, gpus_per_node: int) -> list[str]:
    """Shell words of the prefix for one component; [] without an image.

    The words are already quoted for bash (the always-bound directories and the env file are
    variable expansions the batch script resolves).
    """
    if container.image is None:
        return []
    words = ["apptainer", "exec"]
    if gpus_per_node > 0:
        words.append("--nv")
    for bind in ALWAYS_BOUND:
        words += ["--bind", bind]
    for bind in container.binds:
        words += ["--bind", shlex.quote(bind)]
    if container.env:
        words += ["--env-file", f'"$JOB_DIR/{ENV_FILE}"']
    words.append(shlex.quote(container.image))
    return words


def env_file_text(container: ContainerSpec) -> str:
    """The text of JOBDIR/container.env: one ``NAME=value`` line per ``[container] env`` entry.

    Apptainer evaluates the file with its built-in shell interpreter (on the host, before the
    container starts; command execution disabled), so each value is shell-quoted (single
    quotes where it needs any): apptainer then holds exactly the text ``--env NAME=VALUE``
    would have passed it (commas included, which ``--env`` would have split). The spec checks
    already refused names that are not shell names and control characters in values.
    """
    lines = ["# [container] env of the job spec, read by `apptainer exec --env-file` (written by relax-hpc submit)"]
    for assignment in container.env:
        name, _, value = assignment.partition("=")
        lines.append(f"{name}={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def render_wrapper(component: str, container: ContainerSpec, gpus_per_node: int) -> str:
    """One bash array assignment, e.g. ``WRAP_trainer=(apptainer exec --nv ... img.sif)``."""
    return f"WRAP_{component}=({' '.join(container_prefix(container, gpus_per_node))})"
