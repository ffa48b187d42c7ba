"""Refuse requests the cluster cannot satisfy, before sbatch (pure: spec + sinfo --json nodes).

Slurm would accept some impossible hetjobs and leave them pending forever (more nodes than the
partition has, more GPUs per node than any node carries); these checks say so at once, naming
the spec key to change. The node records are ``sinfo --json``'s (Slurm 22.05 field names).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from relax_hpc.launch.render import components
from relax_hpc.spec import ComponentSpec, JobSpec

__all__ = ["gpus_of", "preflight_problems"]

_GPU_GRES = re.compile(r"gpu(?::[A-Za-z0-9_.-]+)*:(\d+)")


def gpus_of(node: Mapping[str, Any]) -> int:
    """GPUs a node carries, from its gres string ("gpu:8", "gpu:h100:4(S:0-1)"); 0 without."""
    total = 0
    for item in str(node.get("gres") or "").split(","):
        found = _GPU_GRES.match(item.strip())
        if found:
            total += int(found.group(1))
    return total


def _in_partition(node: Mapping[str, Any], partition: str | None) -> bool:
    return partition is None or partition in (node.get("partitions") or [])


def _listed(partition: str | None) -> list[str | None]:
    """The names of a partition value ("gpu,gpu-long"); [None] (the whole cluster) when unset."""
    return list(partition.split(",")) if partition else [None]


def _fit_problems(c: ComponentSpec, key: str, partition: str | None,
                  pool: Sequence[Mapping[str, Any]]) -> list[str]:
    """What one component asks of the nodes of one partition (or the cluster) that they lack."""
    where = f"partition {partition!r}" if partition else "the cluster"
    problems = []
    if c.nodes > len(pool):
        problems.append(f"{key}.nodes = {c.nodes}: {where} has only {len(pool)} node(s)")
    max_gpus = max(gpus_of(node) for node in pool)
    if c.gpus_per_node > max_gpus:
        problems.append(f"{key}.gpus_per_node = {c.gpus_per_node}: the nodes of {where} carry at most "
                        f"{max_gpus} GPU(s); lower gpus_per_node or choose another partition")
    max_cpus = max(int(node.get("cpus") or 0) for node in pool)
    if c.cpus_per_node > max_cpus:
        problems.append(f"{key}.cpus_per_node = {c.cpus_per_node}: the nodes of {where} have at most "
                        f"{max_cpus} CPUs")
    return problems


def preflight_problems(spec: JobSpec, nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """One message per impossible request; [] when the spec fits the cluster.

    A partition list ("gpu,gpu-long") must name partitions that all exist; Slurm runs the
    component in one of them, so it fits when it fits one of them.
    """
    problems: list[str] = []
    known_partitions = sorted({p for node in nodes for p in (node.get("partitions") or [])})
    demand: dict[str | None, list[str]] = {}
    for component in components(spec):
        c, key = component.spec, f"cluster.{component.name}"
        partitions = _listed(c.partition)
        unknown = [name for name in partitions if not any(_in_partition(node, name) for node in nodes)]
        if unknown:
            which = "" if len(partitions) == 1 else " " + ", ".join(repr(name) for name in unknown)
            problems.append(f"{key}.partition = {c.partition!r}: no such partition{which}; "
                            f"known: {', '.join(known_partitions) or '(none)'}")
            continue
        demand.setdefault(c.partition, []).extend([component.name] * c.nodes)
        per_partition = [_fit_problems(c, key, name, [node for node in nodes if _in_partition(node, name)])
                         for name in partitions]
        if all(per_partition):  # no listed partition can hold it: say why for each
            problems += [problem for found in per_partition for problem in found]
    # Slurm never places two components of one hetjob on the same node.
    for partition, wanted in demand.items():
        pool_size = sum(1 for node in nodes if any(_in_partition(node, name) for name in _listed(partition)))
        if len(wanted) > pool_size and len(set(wanted)) > 1:
            where = f"partition {partition!r}" if partition else "the cluster"
            problems.append(f"cluster.*.nodes: the components {', '.join(sorted(set(wanted)))} need "
                            f"{len(wanted)} distinct nodes together (Slurm never shares a node between "
                            f"components of one job), but {where} has {pool_size}")
    return problems
