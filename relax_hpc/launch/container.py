"""The command prefix that runs a component's processes in its Apptainer image (pure).

With ``[container] image`` set, every srun step and the driver run as
``apptainer exec [--nv] --bind ... --env ... IMAGE <command>``; ``--nv`` (the host's NVIDIA
driver inside the container) only for components with GPUs. The job directory and the submit
directory are always bound, so checkpoints, logs and relative paths of the spec work inside.
Without an image the prefix is empty and commands run on the host.
"""

from __future__ import annotations

import shlex

from relax_hpc.spec import ContainerSpec

__all__ = ["ALWAYS_BOUND", "container_prefix", "render_wrapper"]

# Shell words (expanded inside the batch script) bound into every container.
ALWAYS_BOUND = ('"$JOB_DIR"', '"$SLURM_SUBMIT_DIR"')


def container_prefix(container: ContainerSpec, gpus_per_node: int) -> list[str]:
    """Shell words of the prefix for one component; [] without an image.

    The words are already quoted for bash (the two always-bound directories are variable
    expansions the batch script resolves).
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
    for assignment in container.env:
        words += ["--env", shlex.quote(assignment)]
    words.append(shlex.quote(container.image))
    return words


def render_wrapper(component: str, container: ContainerSpec, gpus_per_node: int) -> str:
    """One bash array assignment, e.g. ``WRAP_trainer=(apptainer exec --nv ... img.sif)``."""
    return f"WRAP_{component}=({' '.join(container_prefix(container, gpus_per_node))})"
