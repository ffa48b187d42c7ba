"""Environment for the Ray nodes relax-hpc starts: a local run's ``ray.init`` and each Slurm
node's ``ray start`` (the raylet reads ``RAY_<setting>`` from its environment).

Ray prestarts one idle Python worker per CPU of a node when the first driver connects. The
job's roles are actors that Ray starts workers for on demand, with the job's runtime
environment; the prestarted ones stay idle until the job ends. On a 2-core machine they cost
about 0.65 CPU-seconds of imports each, per run; on a 96-core GPU node, 96 interpreters
competing with the roles' own start-up. A user's own setting wins (``setdefault``).
"""

from __future__ import annotations

from collections.abc import MutableMapping

__all__ = ["RAY_NODE_ENV", "apply_ray_node_env"]

RAY_NODE_ENV: dict[str, str] = {"RAY_prestart_worker_first_driver": "0"}


def apply_ray_node_env(environ: MutableMapping[str, str]) -> None:
    """Add `RAY_NODE_ENV` to ``environ`` where it does not already say otherwise."""
    for name, value in RAY_NODE_ENV.items():
        environ.setdefault(name, value)
