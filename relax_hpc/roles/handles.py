"""Role handles: what the driver calls. Each hides where its role runs (Ray actors or in process).

`RayRoles` places one Rollout actor and `train.num_processes` Actor ranks on the Ray cluster and
serves the transfer queue over ZMQ; `LocalRoles` runs the same workers in this process with an
in-memory queue (fast tests, debugging).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol, Sequence

from relax_hpc.ckpt import ResumeState
from relax_hpc.data.sample import Sample
from relax_hpc.roles.actor import ActorConfig, ActorWorker, rendezvous_address
from relax_hpc.roles.advantages import AdvantagesConfig, AdvantagesWorker
from relax_hpc.roles.engine_host import EngineHost
from relax_hpc.roles.forward import ForwardConfig, ForwardWorker
from relax_hpc.roles.rollout import RolloutConfig, RolloutWorker
from relax_hpc.transfer.memory import InMemoryTransferQueue
from relax_hpc.transfer.queue import partition_name
from relax_hpc.weights.base import InProcessWeightSync, PendingWeights, WeightSync
from relax_hpc.weights.ray_sync import DistributedWeightSync


log = logging.getLogger(__name__)

# The roles that read and write fields of queued rows beside Rollout and Actor.
RoleConfig = ForwardConfig | AdvantagesConfig


def _worker_class(cfg: RoleConfig) -> type[ForwardWorker] | type[AdvantagesWorker]:
    return AdvantagesWorker if isinstance(cfg, AdvantagesConfig) else ForwardWorker


class TrainTicket(Protocol):
    """A submitted training step; `result()` blocks until it is trained and returns its stats.

    The trainer starts the broadcast of the weights it trained as the step's `publish_version`
    right after the step; `published()`, called once after `result()`, hands back that
    broadcast (its `wait()` returns when every receiver holds the version)."""

    def result(self) -> dict[str, float]: ...
    def published(self) -> PendingWeights: ...


class Roles(Protocol):
    """What the driver calls. Rollout runs its own producer loop into the transfer queue, paced by
    the staleness rule; the trainer consumes one partition per step. `start_version` is the weight
    version the trainer starts from: with it rollout and ActorFwd know which version each step needs.
    Calls to the trainer run in the order they are made: a step submitted while another trains
    runs after it and after that step's broadcast has started."""

    weights: WeightSync

    def start_rollout(self, start_step: int, total_steps: int, max_staleness: int, start_version: int) -> None: ...
    def start_train(self, step: int, publish_version: int) -> TrainTicket: ...
    def clear_step(self, step: int) -> None: ...
    def step_report(self, step: int) -> tuple[dict[str, float], dict]: ...
    def save_checkpoint(self, state: ResumeState) -> str: ...
    def load_checkpoint(self) -> ResumeState | None: ...
    def restore_cursor(self, state: dict) -> None: ...
    def dataset_summary(self) -> str: ...
    def engine_report(self) -> list[dict[str, Any]]: ...
    def shutdown(self) -> None: ...


def mean_stats(all_stats: list[dict[str, float]]) -> dict[str, float]:
    keys = all_stats[0].keys()
    return {k: sum(s[k] for s in all_stats) / len(all_stats) for k in keys}


class LocalRoles:
    """Every role in this process (one trainer rank); the queue is in memory."""

    def __init__(self, rollout: RolloutConfig, actor: ActorConfig, queue_roles: Sequence[RoleConfig] = (),
                 capacity: int | None = None, timeout_s: float = 600.0) -> None:
        self.queue = InMemoryTransferQueue(capacity=capacity)
        self.rollout = RolloutWorker(rollout)
        self.queue_roles = [_worker_class(f)(f) for f in queue_roles]
        self.actor = ActorWorker(actor)
        receivers = [self.rollout, *(f for f in self.queue_roles if f.cfg.kind == "actor_fwd")]
        self.weights: WeightSync = InProcessWeightSync(self.actor, receivers)
        self.timeout_s = timeout_s

    def start_rollout(self, start_step: int, total_steps: int, max_staleness: int, start_version: int) -> None:
        self.rollout.start_producer(self.queue, start_step, total_steps, max_staleness, start_version)
        for f in self.queue_roles:
            f.start(self.queue, start_step, total_steps, start_version=start_version)

    def _errors(self) -> str | None:
        found = [e for e in (self.rollout.producer_error(), *(f.error() for f in self.queue_roles)) if e]
        return "; ".join(found) or None

    def start_train(self, step: int, publish_version: int) -> TrainTicket:
        # Lazy: in one process the step runs when the loop asks for it, after the clear that
        # lets a strictly on-policy rollout produce it; its weights are handed over right after.
        return _LazyTicket(lambda: _guard(self._errors, lambda: self.actor.train_from_queue(
            self.queue, step, self.timeout_s)), lambda: self.weights.start(publish_version))

    def clear_step(self, step: int) -> None:
        self.queue.clear(partition_name(step))

    def step_report(self, step: int) -> tuple[dict[str, float], dict]:
        return self.rollout.step_report(step)

    def save_checkpoint(self, state: ResumeState) -> str:
        return self.actor.save_checkpoint(state)

    def load_checkpoint(self) -> ResumeState | None:
        return self.actor.load_checkpoint()

    def restore_cursor(self, state: dict) -> None:
        self.rollout.restore_cursor(state)

    def dataset_summary(self) -> str:
        return self.rollout.dataset_summary()

    def engine_report(self) -> list[dict[str, Any]]:
        return self.rollout.engine_report()

    def shutdown(self) -> None:
        self.rollout.stop_producer()
        for f in self.queue_roles:
            f.stop()
        self.actor.shutdown()


class _LazyTicket:
    def __init__(self, run: Callable[[], dict[str, float]], publish: Callable[[], PendingWeights]) -> None:
        self._run, self._publish = run, publish
        self._published: PendingWeights | None = None

    def result(self) -> dict[str, float]:
        stats = self._run()
        t0 = time.perf_counter()
        self._published = self._publish()
        stats["sync_s"] = time.perf_counter() - t0
        return stats

    def published(self) -> PendingWeights:
        if self._published is None:
            raise RuntimeError("published() before result(): the step has not trained yet")
        return self._published


class _RayTicket:
    """Trainer ranks' step on Ray. While waiting it asks the producing roles every `poll_s`
    whether they failed: a dead rollout then ends the step at once with its error, instead of
    after the trainer's queue timeout (the stuck trainer is killed at shutdown)."""

    def __init__(self, refs: list[Any], errors: Callable[[], str | None], poll_s: float = 1.0,
                 publish: Callable[[], PendingWeights] | None = None) -> None:
        self._refs, self._errors, self._poll_s = refs, errors, poll_s
        self._publish = publish
        self.done = False

    def result(self) -> dict[str, float]:
        import ray

        while True:
            ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=self._poll_s)
            if len(ready) == len(self._refs):
                break
            error = self._errors()
            if error:
                raise RuntimeError(f"{error} (the trainer was waiting for that step's rows)")
        stats = _guard(self._errors, lambda: _merge_rank_stats(ray.get(self._refs)))
        self.done = True
        return stats

    def published(self) -> PendingWeights:
        """The receivers' side of the broadcast rank 0 started after this step, posted now."""
        if not self.done or self._publish is None:
            raise RuntimeError("published() needs a finished step submitted with a publish_version")
        return self._publish()


def _guard(producer_error: Any, train: Any) -> dict[str, float]:
    """Run a train step; if it fails because a producing role died, say so instead of a queue timeout."""
    try:
        return train()
    except Exception as e:
        error = producer_error()
        if error:
            raise RuntimeError(error) from e
        raise


def _node_and_rendezvous() -> tuple[str, str]:
    import ray

    return ray.get_runtime_context().get_node_id(), rendezvous_address()


class RayRoles:
    """Rollout and Actor ranks as Ray actors, placed by component resources when the cluster has them.

    The transfer queue server runs in the driver process (on the head node); roles connect to it
    over ZMQ.
    """

    def __init__(self, rollout: RolloutConfig, actor: ActorConfig, num_processes: int,
                 queue_roles: Sequence[RoleConfig] = (), capacity: int | None = None,
                 timeout_s: float = 600.0) -> None:
        import ray

        from relax_hpc.transfer.zmq_client import TransferQueueClient
        from relax_hpc.transfer.zmq_server import TransferQueueServer

        host = ray.util.get_node_ip_address()
        self._server = TransferQueueServer(f"tcp://{host}:0", capacity=capacity)
        self.queue_address = self._server.start()
        self._queue = TransferQueueClient(self.queue_address, consumer_id="driver")
        self.timeout_s = timeout_s
        self._ticket: _RayTicket | None = None  # the last submitted training step
        self._total_steps = 0  # set by start_rollout: the trainer prefetches up to the last step
        shared = rollout.release_between_steps  # engines and trainer ranks take turns on each GPU
        # N > 1 engines run in actors of their own (a GPU each on GPUs), behind rollout's router.
        self._engines = [
            ray.remote(EngineHost).options(**self._placement("rollout"), **_gpus(rollout.device, shared)).remote(
                rollout.engine, rollout.model_path, rollout.dtype, rollout.device, rollout.num_threads)
            for _ in range(rollout.num_engines if rollout.num_engines > 1 else 0)
        ]
        # max_concurrency: new weights and status calls must reach rollout while it produces.
        self._rollout = ray.remote(RolloutWorker).options(
            max_concurrency=4, **self._placement("rollout"),
            **({} if self._engines else _gpus(rollout.device, shared)),
        ).remote(rollout, engine_hosts=self._engines or None)
        # Rank 0's node hosts the TCP store of the trainer's process group: a task on a trainer
        # node picks the address, and rank 0 is pinned to that node.
        placement = self._placement("trainer")
        master, rank0 = "", placement
        if num_processes > 1:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            node_id, master = ray.get(ray.remote(_node_and_rendezvous).options(**placement).remote())
            rank0 = {**placement, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
        self._actors = [
            ray.remote(ActorWorker).options(**(rank0 if rank == 0 else placement),
                                            **_gpus(actor.device, shared)).remote(
                actor, rank, num_processes, master)
            for rank in range(num_processes)
        ]
        # ActorFwd / Reference / Advantages go to the forward component when the cluster has one.
        self._queue_roles = [
            ray.remote(_worker_class(f)).options(max_concurrency=4, **self._placement("forward")).remote(f)
            for f in queue_roles
        ]
        ray.get([self._rollout.weight_version.remote(), *(f.weight_version.remote() for f in self._queue_roles)])
        # Trainer rank 0 broadcasts to every engine (and ActorFwd) over gloo / NCCL in buckets.
        fwd = [(h, f) for h, f in zip(self._queue_roles, queue_roles)
               if isinstance(f, ForwardConfig) and f.kind == "actor_fwd"]
        self.weights = DistributedWeightSync(
            self._actors[0], [self._rollout, *(h for h, _ in fwd)], host=host, device=actor.device,
            receiver_devices=[rollout.device, *(f.device for _, f in fwd)],
            labels=["rollout 0", *("actor_fwd" for _ in fwd)],
        )

    @staticmethod
    def _placement(component: str) -> dict[str, Any]:
        import ray

        if ray.cluster_resources().get(component, 0) > 0:
            return {"num_cpus": 0, "resources": {component: 0.01}}
        return {"num_cpus": 0}

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(a, method).remote(*args) for a in self._actors])

    def _rollout_call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self._rollout, method).remote(*args))

    def start_rollout(self, start_step: int, total_steps: int, max_staleness: int, start_version: int) -> None:
        import ray

        self._total_steps = total_steps
        self.weights.connect()  # before any step is queued on the trainer: it opens the channel
        self._rollout_call("start_producer", self.queue_address, start_step, total_steps, max_staleness,
                           start_version)
        ray.get([f.start.remote(self.queue_address, start_step, total_steps, start_version=start_version)
                 for f in self._queue_roles])

    def _errors(self) -> str | None:
        import ray

        found = [self._rollout_call("producer_error"), *ray.get([f.error.remote() for f in self._queue_roles])]
        return "; ".join(e for e in found if e) or None

    def start_train(self, step: int, publish_version: int) -> TrainTicket:
        # Each rank asks for its first rows of the next step now, so they are on their way by
        # the time this step ends (when rollout runs ahead, they are usually there already).
        # Rank 0 starts the broadcast of the trained weights itself; the receivers are posted
        # once the step is back (`published`), after the previous broadcast was waited for.
        after = step + 1 if step + 1 < self._total_steps else None
        refs = [a.train_from_queue.remote(self.queue_address, step, self.timeout_s, after, publish_version)
                for a in self._actors]
        self._ticket = _RayTicket(refs, self._errors, publish=lambda: self.weights.expect(publish_version))
        return self._ticket

    def clear_step(self, step: int) -> None:
        # The driver clears through its own client: every trainer rank has acked its rows by
        # now, and a rollout held by the staleness bound waits for this clear.
        self._queue.clear(partition_name(step))

    def step_report(self, step: int) -> tuple[dict[str, float], dict]:
        return self._rollout_call("step_report", step)

    def save_checkpoint(self, state: ResumeState) -> str:
        return self._all("save_checkpoint", state)[0]

    def load_checkpoint(self) -> ResumeState | None:
        return self._all("load_checkpoint")[0]

    def restore_cursor(self, state: dict) -> None:
        self._rollout_call("restore_cursor", state)

    def dataset_summary(self) -> str:
        return self._rollout_call("dataset_summary")

    def engine_report(self) -> list[dict[str, Any]]:
        return self._rollout_call("engine_report")

    def engine_pids(self) -> list[int]:
        """The process ids of the engine actors (tests kill one to check nothing is lost)."""
        import ray

        return ray.get([e.pid.remote() for e in self._engines])

    def shutdown(self) -> None:
        import ray

        try:
            stopping = [self._rollout.stop_producer.remote(), *(f.stop.remote() for f in self._queue_roles)]
            ray.get(stopping, timeout=60)
            # A trainer still inside a step (the loop failed) would answer only after its queue
            # timeout: it is killed below without the polite part.
            if self._ticket is None or self._ticket.done:
                self.weights.close()
                self._all("shutdown")
        except Exception as e:  # noqa: BLE001 - a role that already died; the loop's own error matters
            log.warning("roles did not shut down cleanly (%s: %s); killing them", type(e).__name__, e)
        finally:
            for a in [*self._actors, self._rollout, *self._engines, *self._queue_roles]:
                ray.kill(a)
            self._queue.close()
            self._server.stop()


def _gpus(device: str, shared: bool = False) -> dict[str, float]:
    """One GPU for an actor whose role runs on CUDA (Ray then sets its CUDA_VISIBLE_DEVICES);
    half of one where engines and trainer ranks share devices ([cluster] colocate), so that
    Ray puts an engine and a trainer rank on each GPU."""
    if not device.startswith("cuda"):
        return {}
    return {"num_gpus": 0.5 if shared else 1}


def _merge_rank_stats(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Rows and reward sums add up over ranks; the loss statistics are already global means; a
    step takes as long as its slowest rank (and only rank 0 starts the broadcast)."""
    merged = mean_stats(per_rank)
    merged["rows"] = sum(s["rows"] for s in per_rank)
    merged["reward_sum"] = sum(s["reward_sum"] for s in per_rank)
    for key in ("train_s", "sync_s", "queue_wait_s"):
        if key in merged:
            merged[key] = max(s[key] for s in per_rank)
    return merged
