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
from relax_hpc.spec import JobSpec

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


def preflight_problems(spec: JobSpec, nodes: Sequence[Mapping[str, Any]]) -> list[str]:
    """One message per impossible request; [] when the spec fits the cluster."""
    problems: list[str] = []
    known_partitions = sorted({p for node in nodes for p in (node.get("partitions") or [])})
    demand: dict[str | None, list[str]] = {}
    for component in components(spec):
        c, key = component.spec, f"cluster.{component.name}"
        where = f"partition {c.partition!r}" if c.partition else "the cluster"
        pool = [node for node in nodes if _in_partition(node, c.partition)]
        if not pool:
            problems.append(f"{key}.partition = {c.partition!r}: no such partition; "
                            f"known: {', '.join(known_partitions) or '(none)'}")
            continue
        demand.setdefault(c.partition, []).extend([component.name] * c.nodes)
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
    # Slurm never places two components of one hetjob on the same node.
    for partition, wanted in demand.items():
        pool_size = sum(1 for node in nodes if _in_partition(node, partition))
        if len(wanted) > pool_size and len(set(wanted)) > 1:
            where = f"partition {partition!r}" if partition else "the cluster"
            problems.append(f"cluster.*.nodes: the components {', '.join(sorted(set(wanted)))} need "
                            f"{len(wanted)} distinct nodes together (Slurm never shares a node between "
                            f"components of one job), but {where} has {pool_size}")
    return problems
