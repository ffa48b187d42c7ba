"""The command prefix that runs a component's processes in its Apptainer image (pure).

With ``[container] image`` set, every srun step and the driver run as
``bash -c TASK_EXEC container [--nv] --bind ... [--env-file "$JOB_DIR/container.env"] IMAGE <command>``:
TASK_EXEC runs in each Slurm task, finds ``apptainer`` (else ``singularity``) on that node's
PATH, and execs ``apptainer exec --cleanenv ...``. With --cleanenv nothing of the host's
environment reaches the job except what it needs (JOB_ENV): the job's own variables, Slurm's
per-task ones and the GPUs Slurm gave the task. They are read in the task, where Slurm set
them (a value expanded in the batch script would be the batch step's), and handed over as
``APPTAINERENV_NAME`` (``SINGULARITYENV_NAME``), which keeps commas (``--env`` would split
CUDA_VISIBLE_DEVICES=0,1). The image's own %environment (PATH, RELAX_SGLANG_ENV,
RELAX_MEGATRON_ENV; container/relax.def) applies inside. ``--nv`` (the host's NVIDIA driver
inside the container) only for components with GPUs. The job directory and the submit
directory are always bound, so checkpoints, logs and relative paths of the spec work inside.
Without an image the prefix is empty and commands run on the host.

``[container] env`` values may be secrets (a W&B key, a hub token), so they never appear on a
command line (``ps`` shows it to every user of the node) or in the batch script: `relax-hpc
submit` writes them into JOBDIR/container.env, owner-only, with :func:`env_file_text`, and the
prefix names that file (``apptainer exec --env-file``).
"""

from __future__ import annotations

import shlex

from relax_hpc.spec import ContainerSpec

__all__ = ["ALWAYS_BOUND", "ENV_FILE", "IMAGE_MEGATRON_PYTHON", "JOB_ENV", "TASK_EXEC", "container_prefix",
           "env_file_text", "render_wrapper"]

# Shell words (expanded inside the batch script) bound into every container.
ALWAYS_BOUND = ('"$JOB_DIR"', '"$SLURM_SUBMIT_DIR"')
# The [container] env assignments, in the job directory (written by submit, mode 0600).
ENV_FILE = "container.env"
# What a job's processes read from their environment (hetjob.sbatch.in exports the first four;
# Slurm sets the rest per task). Everything else of the host's environment stays outside.
JOB_ENV = ("RELAX_HPC_SECRET_FILE", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "TOKENIZERS_PARALLELISM",
           "SLURM_JOB_ID", "SLURM_SUBMIT_DIR", "SLURM_RESTART_COUNT", "SLURM_NODEID", "SLURM_PROCID",
           "SLURM_LOCALID", "SLURMD_NODENAME", "SLURM_CPUS_PER_TASK", "CUDA_VISIBLE_DEVICES")
# Run in each task: the container runtime of this node, JOB_ENV handed over, then `exec --cleanenv`.
TASK_EXEC = (
    'b=$(command -v apptainer || command -v singularity) || { echo "relax-hpc: neither apptainer nor '
    'singularity is on PATH on $(hostname); load its module in [slurm] setup" >&2; exit 127; }; '
    'p=APPTAINERENV_; case $b in */singularity) p=SINGULARITYENV_;; esac; '
    f'for v in {" ".join(JOB_ENV)}; do if [ -n "${{!v+x}}" ]; then export "$p$v=${{!v}}"; fi; done; '
    'exec "$b" exec --cleanenv "$@"'
)
# The Megatron environment's interpreter in an image built from container/relax.def: a spec with
# [train] backend = "megatron" runs every process of the job with it.
IMAGE_MEGATRON_PYTHON = "/opt/relax-hpc/.venv-megatron/bin/python"


def container_prefix(container: ContainerSpec, gpus_per_node: int) -> list[str]:
    """Shell words of the prefix for one component; [] without an image.

    The words are already quoted for bash (the always-bound directories and the env file are
    variable expansions the batch script resolves).
    """
    if container.image is None:
        return []
    words = ["bash", "-c", shlex.quote(TASK_EXEC), "container"]
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
    """One bash array assignment, e.g. ``WRAP_trainer=(bash -c '...' container --nv ... img.sif)``."""
    return f"WRAP_{component}=({' '.join(container_prefix(container, gpus_per_node))})"
