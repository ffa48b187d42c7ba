"""Where each role of a Ray run goes: its node, its GPUs, its component's resources.

A cluster started by the job script carries a resource per component (`trainer`, `rollout`,
`forward`: docs/slurm.md); an actor asks for a sliver of its component's, so it lands on that
component's nodes, and for nothing of the kind on a cluster without them. An actor whose role
runs on CUDA takes one GPU (Ray then sets its CUDA_VISIBLE_DEVICES), half of one where engines
and trainer ranks take turns on the devices ([cluster] colocate). Trainer rank 0 is pinned to
the node that hosts its process group's TCP store, and so is the critic's (`place_ranks`).
`RayRoles` (roles/handles.py) and `CriticRoles` place their roles through these functions.
"""

from __future__ import annotations

from typing import Any

from relax_hpc.engines.fleet import engine_actor_count, gpus_per_rollout
from relax_hpc.roles.actor import ActorConfig, ActorWorker
from relax_hpc.roles.advantages import AdvantagesConfig, AdvantagesWorker
from relax_hpc.roles.engine_host import EngineHost
from relax_hpc.roles.forward import ForwardConfig, ForwardWorker
from relax_hpc.roles.rendezvous import node_and_rendezvous
from relax_hpc.roles.rollout import RolloutConfig, RolloutWorker
from relax_hpc.roles.supervision import ROLE_START_TIMEOUT_S, get_from_roles

# The roles that read and write fields of queued rows beside Rollout and Actor.
RoleConfig = ForwardConfig | AdvantagesConfig


def worker_class(cfg: RoleConfig) -> type[ForwardWorker] | type[AdvantagesWorker]:
    return AdvantagesWorker if isinstance(cfg, AdvantagesConfig) else ForwardWorker


def component_placement(component: str) -> dict[str, Any]:
    """Ray options that put an actor on `component`'s nodes when the cluster has that resource."""
    import ray

    if ray.cluster_resources().get(component, 0) > 0:
        return {"num_cpus": 0, "resources": {component: 0.01}}
    return {"num_cpus": 0}


def gpus(device: str, shared: bool = False) -> dict[str, float]:
    """One GPU for an actor whose role runs on CUDA (Ray then sets its CUDA_VISIBLE_DEVICES);
    half of one where engines and trainer ranks share devices ([cluster] colocate), so that
    Ray puts an engine and a trainer rank on each GPU."""
    if not device.startswith("cuda"):
        return {}
    return {"num_gpus": 0.5 if shared else 1}


def rollout_gpus(rollout: RolloutConfig, shared: bool) -> dict[str, float]:
    """The rollout actor's GPUs: its engine's, or with SGLang every server's (`tp_size` each;
    the servers it starts see the actor's CUDA_VISIBLE_DEVICES)."""
    found = gpus(rollout.device, shared)
    return {"num_gpus": gpus_per_rollout(rollout, found["num_gpus"])} if found else found


def place_rollout(rollout: RolloutConfig, shared: bool) -> tuple[Any, list[Any]]:
    """The rollout actor and the engine actors behind its router (none for one engine).

    Which engines run in actors of their own is the fleet's rule (engines/fleet.py:
    `engine_actor_count`)."""
    import ray

    host_options = {**component_placement("rollout"), **gpus(rollout.device, shared)}
    engines = [
        ray.remote(EngineHost).options(**host_options).remote(
            rollout.engine, rollout.model_path, rollout.dtype, rollout.device, rollout.num_threads,
            rollout.routing_replay)
        for _ in range(engine_actor_count(rollout))
    ]
    # max_concurrency: new weights and status calls must reach rollout while it produces.
    worker = ray.remote(RolloutWorker).options(
        max_concurrency=4, **component_placement("rollout"),
        **({} if engines else rollout_gpus(rollout, shared)),
    ).remote(rollout, engine_hosts=engines or None, engine_host_options=host_options)
    return worker, engines


def place_trainer_ranks(actor: ActorConfig, num_processes: int, shared: bool) -> list[Any]:
    """The trainer's ranks, by rank (`place_ranks` on the trainer's component)."""
    return place_ranks(ActorWorker, actor, num_processes, "trainer", gpus(actor.device, shared), "trainer")


def place_ranks(worker: type, cfg: Any, num_processes: int, component: str, devices: dict[str, float],
                group: str) -> list[Any]:
    """`num_processes` ranks of one process group (`worker(cfg, rank, num_processes, master)`),
    by rank, on `component`'s nodes, each with `devices`. Rank 0's node hosts the TCP store of
    the group: a task on a node of the component picks the address, and rank 0 is pinned there."""
    import ray

    placement = component_placement(component)
    master, rank0 = "", placement
    if num_processes > 1:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(node_and_rendezvous).options(**placement).remote()
        node_id, master = get_from_roles([(f"a task on a {component} node", task)],
                                         f"picking the {group}'s rendezvous address", ROLE_START_TIMEOUT_S)[0]
        rank0 = {**placement, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
    return [
        ray.remote(worker).options(**(rank0 if rank == 0 else placement), **devices).remote(
            cfg, rank, num_processes, master)
        for rank in range(num_processes)
    ]


def place_queue_role(cfg: RoleConfig) -> Any:
    """An ActorFwd, Reference or Advantages worker, on the forward component when the cluster has one."""
    import ray

    return ray.remote(worker_class(cfg)).options(max_concurrency=4, **component_placement("forward")).remote(cfg)

