"""Ray ports and temp dirs for one node of one Slurm job, derived from the job id (pure).

Two jobs that share a host must not collide, and on the dev cluster several Slurm "nodes" of
one job are the same host, so every (job id, node slot) pair gets its own block of ports and
its own temp dir. A slot is the node's index across the whole hetjob: 0 is the Ray head (the
first trainer node), then the other trainer nodes, then rollout, then forward.

The last ``2 * ENGINES_PER_NODE`` ports of a block are the rollout engines' (an SGLang server's
HTTP port and its weight-update group's store, `engine_ports`); the node launcher exports
``PORT_SLOT_ENV`` = "<job id>:<slot>" to Ray, so the rollout role on that node finds them.

Ports stay in [10000, 32000): below Linux's ephemeral range (32768+), where outgoing
connections would otherwise grab them at random. Consecutive job ids use disjoint blocks as
long as each job has at most ``SLOTS_PER_JOB`` nodes; the node launcher still checks that
its ports are free and fails with a clear message when they are not.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BLOCK_SIZE", "ENGINES_PER_NODE", "PORT_HIGH", "PORT_LOW", "PORT_SLOT_ENV", "SLOTS_PER_JOB",
           "EnginePorts", "RayPorts", "engine_ports", "port_slot_from_env", "ray_ports", "ray_temp_dir"]

PORT_LOW = 10000
PORT_HIGH = 32000
BLOCK_SIZE = 64
SLOTS_PER_JOB = 8
_BLOCKS = (PORT_HIGH - PORT_LOW) // BLOCK_SIZE  # 343 = 7**3, coprime to SLOTS_PER_JOB
# The first ports of a block are named services, the last the engines'; Ray workers between.
_FIRST_WORKER_OFFSET = 10
ENGINES_PER_NODE = 8  # SGLang servers one rollout node can give planned ports to
_FIRST_ENGINE_OFFSET = BLOCK_SIZE - 2 * ENGINES_PER_NODE
PORT_SLOT_ENV = "RELAX_HPC_PORT_SLOT"  # "<job id>:<slot>", set for Ray by the node launcher


@dataclass(frozen=True)
class RayPorts:
    """Every port one Ray node (head or worker) listens on."""

    gcs: int  # the head's --port (workers join HEAD:gcs)
    node_manager: int
    object_manager: int
    dashboard_agent_listen: int
    dashboard_agent_grpc: int
    metrics_export: int
    runtime_env_agent: int
    ray_client_server: int
    dashboard: int
    min_worker: int
    max_worker: int

    def all_ports(self) -> list[int]:
        """Every port in the block this node uses (the worker range expanded)."""
        named = [self.gcs, self.node_manager, self.object_manager, self.dashboard_agent_listen,
                 self.dashboard_agent_grpc, self.metrics_export, self.runtime_env_agent,
                 self.ray_client_server, self.dashboard]
        return named + list(range(self.min_worker, self.max_worker + 1))


def _block_start(job_id: int, slot: int) -> int:
    if job_id < 0 or slot < 0:
        raise ValueError(f"job id and node slot must be >= 0, got job {job_id}, slot {slot}")
    return PORT_LOW + ((job_id * SLOTS_PER_JOB + slot) % _BLOCKS) * BLOCK_SIZE


def ray_ports(job_id: int, slot: int) -> RayPorts:
    """The ports of node ``slot`` of Slurm job ``job_id``."""
    start = _block_start(job_id, slot)
    return RayPorts(
        gcs=start, node_manager=start + 1, object_manager=start + 2,
        dashboard_agent_listen=start + 3, dashboard_agent_grpc=start + 4, metrics_export=start + 5,
        runtime_env_agent=start + 6, ray_client_server=start + 7, dashboard=start + 8,
        min_worker=start + _FIRST_WORKER_OFFSET, max_worker=start + _FIRST_ENGINE_OFFSET - 1,
    )


@dataclass(frozen=True)
class EnginePorts:
    """The ports of one rollout engine server."""

    http: int
    update_group: int  # the store of its weight-update group (rank 0, the rollout process, listens)


def engine_ports(job_id: int, slot: int, index: int) -> EnginePorts:
    """The ports of engine ``index`` on node ``slot`` of job ``job_id``."""
    if not 0 <= index < ENGINES_PER_NODE:
        raise ValueError(f"engine {index}: a rollout node has planned ports for {ENGINES_PER_NODE} engine servers; "
                         "spread [rollout] num_engines over more rollout nodes")
    first = _block_start(job_id, slot) + _FIRST_ENGINE_OFFSET + 2 * index
    return EnginePorts(http=first, update_group=first + 1)


def port_slot_from_env(environ: dict[str, str] | None = None) -> tuple[int, int] | None:
    """(job id, slot) from ``PORT_SLOT_ENV``; None outside a Slurm job's nodes (a local run)."""
    import os

    value = (os.environ if environ is None else environ).get(PORT_SLOT_ENV, "")
    job, _, slot = value.partition(":")
    if not (job.isdigit() and slot.isdigit()):
        return None
    return int(job), int(slot)


def ray_temp_dir(job_id: int, slot: int, root: str = "/tmp") -> str:
    """A short per-(job, node) Ray temp dir: Ray's Unix socket paths must stay under ~107 bytes."""
    return f"{root.rstrip('/')}/relax-{job_id}-{slot}"
