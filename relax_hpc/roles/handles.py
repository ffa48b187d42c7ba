"""Role handles: what the driver calls. Each hides where its role runs (Ray actors or in process).

`RayRoles` places one Rollout actor and `train.num_processes` Actor ranks on the Ray cluster
(where each goes: roles/placement.py) and serves the transfer queue over ZMQ; `LocalRoles` runs
the same workers in this process with an in-memory queue (fast tests, debugging).

Every call the driver makes to a Ray role has a deadline, and a role that dies or hangs ends the
call at once with `RoleDiedError` or `RoleTimeoutError`, naming the role, what it was doing and
where its log is (roles/supervision.py); a training step is polled instead, rank by rank
(`_RayTicket`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Protocol, Sequence

from relax_hpc.ckpt import ResumeState
from relax_hpc.engines.elastic.api import ElasticReply
from relax_hpc.roles.actor import ActorConfig, ActorWorker
from relax_hpc.roles.errors import RoleDiedError, RoleTimeoutError, short_cause
from relax_hpc.roles.forward import ForwardConfig
from relax_hpc.roles.healing import RoleHealer
from relax_hpc.roles.placement import (
    RoleConfig,
    place_queue_role,
    place_rollout,
    place_trainer_ranks,
    worker_class,
)
from relax_hpc.roles.rollout import RolloutConfig, RolloutWorker, engine_role_name
from relax_hpc.roles.supervision import (
    CHECKPOINT_TIMEOUT_S,
    PROBE_WAIT_S,
    ROLE_START_TIMEOUT_S,
    STATUS_TIMEOUT_S,
    get_from_roles,
    guarded_step,
    result_of,
)
from relax_hpc.spec.schema import SecuritySpec
from relax_hpc.transfer.memory import InMemoryTransferQueue
from relax_hpc.transfer.queue import partition_name
from relax_hpc.weights.base import InProcessWeightSync, PendingWeights, WeightSync
from relax_hpc.weights.ray_sync import DistributedWeightSync

log = logging.getLogger(__name__)

__all__ = ["LocalRoles", "RayRoles", "RoleDiedError", "RoleTimeoutError", "Roles", "TrainTicket", "get_from_roles"]


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
    def memory_report(self) -> list[dict[str, Any]]:
        """Every trainer rank's, rollout's and engine actor's bytes held (relax_hpc/roles/memory.py)."""
    def elastic(self, action: str, body: dict[str, Any]) -> ElasticReply:
        """One elastic REST request, answered by rollout (engines/elastic/api.py)."""
    def shutdown(self, abandon: bool = False) -> None: ...


def mean_stats(all_stats: list[dict[str, float]]) -> dict[str, float]:
    keys = all_stats[0].keys()
    return {k: sum(s[k] for s in all_stats) / len(all_stats) for k in keys}


class LocalRoles:
    """Every role in this process (one trainer rank); the queue is in memory."""

    def __init__(self, rollout: RolloutConfig, actor: ActorConfig, queue_roles: Sequence[RoleConfig] = (),
                 capacity: int | None = None, timeout_s: float = 600.0) -> None:
        self.queue = InMemoryTransferQueue(capacity=capacity)
        self.rollout = RolloutWorker(rollout)
        self.queue_roles = [worker_class(f)(f) for f in queue_roles]
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
        return _LazyTicket(lambda: guarded_step(self._errors, lambda: self.actor.train_from_queue(
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

    def memory_report(self) -> list[dict[str, Any]]:
        return [self.actor.memory_record(), self.rollout.memory_record()]

    def elastic(self, action: str, body: dict[str, Any]) -> ElasticReply:
        return self.rollout.elastic(action, body)

    def shutdown(self, abandon: bool = False) -> None:
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
    """Trainer ranks' step on Ray. While waiting it looks every `poll_s` at the ranks and asks the
    producing roles whether they failed: a rank that died or failed, or a failed rollout, ends
    the step at once with its error, instead of after the other ranks' collective or the queue
    timeout (the stuck ranks are killed at shutdown)."""

    def __init__(self, refs: list[Any], errors: Callable[[], str | None], poll_s: float = 1.0,
                 publish: Callable[[], PendingWeights] | None = None, doing: str = "training") -> None:
        self._refs, self._errors, self._poll_s = refs, errors, poll_s
        self._publish, self._doing = publish, doing
        self.done = False

    def result(self) -> dict[str, float]:
        import ray

        calls = [(f"trainer rank {rank}", ref) for rank, ref in enumerate(self._refs)]
        results: dict[Any, dict[str, float]] = {}
        pending = list(self._refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=self._poll_s)
            for ref in ready:
                results[ref] = guarded_step(self._errors, lambda ref=ref: result_of(calls, ref, self._doing, results))
            if pending:
                error = self._errors()
                if error:
                    raise RuntimeError(f"{error} (the trainer was waiting for that step's rows)")
        stats = _merge_rank_stats([results[ref] for ref in self._refs])
        self.done = True
        return stats

    def published(self) -> PendingWeights:
        """The receivers' side of the broadcast rank 0 started after this step, posted now."""
        if not self.done or self._publish is None:
            raise RuntimeError("published() needs a finished step submitted with a publish_version")
        return self._publish()


class RayRoles:
    """Rollout and Actor ranks as Ray actors, placed by component resources when the cluster has them.

    The transfer queue server runs in the driver process (on the head node); roles connect to it
    over ZMQ.
    """

    def __init__(self, rollout: RolloutConfig, actor: ActorConfig, num_processes: int,
                 queue_roles: Sequence[RoleConfig] = (), capacity: int | None = None,
                 timeout_s: float = 600.0, healer: RoleHealer | None = None,
                 security: SecuritySpec | None = None) -> None:
        import ray

        from relax_hpc.auth import job_secret
        from relax_hpc.transfer.zmq_client import TransferQueueClient
        from relax_hpc.transfer.zmq_server import TransferQueueServer

        host = ray.util.get_node_ip_address()
        # [security] payload: how the rows of roles on other nodes travel (transfer/seal.py)
        payload = (security or SecuritySpec()).payload
        self._server = TransferQueueServer(f"tcp://{host}:0", capacity=capacity, secret=job_secret(), payload=payload)
        self.queue_address = self._server.start()
        self._queue = TransferQueueClient(self.queue_address, secret=job_secret(), consumer_id="driver")
        self.timeout_s = timeout_s
        self._healer = healer  # heartbeats, stale roles, restarts (relax_hpc/roles/healing.py)
        self._probes: dict[str, Any] = {}  # role -> its error report still on its way
        self._next_uncleared = 0  # the oldest step not yet cleared: where a restarted role starts
        self._start_version = 0
        self._seen_failed_engines: set[str] = set()
        self._last_engine_check = 0.0
        self._ticket: _RayTicket | None = None  # the last submitted training step
        self._total_steps = 0  # set by start_rollout: the trainer prefetches up to the last step
        shared = rollout.release_between_steps  # engines and trainer ranks take turns on each GPU
        if healer is not None:  # engines started at run time beat too
            rollout = dataclasses.replace(rollout, engine_heartbeat_interval_s=healer.cfg.heartbeat_s)
        self._rollout_cfg = rollout
        self._rollout, self._engines = place_rollout(rollout, shared)
        self._actors = place_trainer_ranks(actor, num_processes, shared)
        self._queue_role_cfgs = list(queue_roles)
        self._queue_roles = [place_queue_role(f) for f in queue_roles]
        self._queue_role_names = [f.kind for f in queue_roles]
        # Every role answers once it is placed and built: a role that cannot start is named now.
        started = get_from_roles(
            [("rollout", self._rollout.weight_version.remote()),
             *((name, f.weight_version.remote()) for name, f in zip(self._queue_role_names, self._queue_roles)),
             *((f"trainer rank {rank}", a.pid.remote()) for rank, a in enumerate(self._actors))],
            "starting (placed by Ray, loading its model)", ROLE_START_TIMEOUT_S)
        self._trainer_pids: list[int] = started[len(started) - num_processes:]
        if healer is not None:
            self._start_heartbeats()
        # Trainer rank 0 broadcasts to every engine (and ActorFwd) over gloo / NCCL in buckets. It
        # hosts the channel's store on its own node, on the interface that routes to this one (`host`),
        # and tells the driver that address for the receivers.
        fwd = [(h, f) for h, f in zip(self._queue_roles, queue_roles)
               if isinstance(f, ForwardConfig) and f.kind == "actor_fwd"]
        self.weights = DistributedWeightSync(
            self._actors[0], [self._rollout, *(h for h, _ in fwd)], host=host, device=actor.device,
            receiver_devices=[rollout.device, *(f.device for _, f in fwd)],
            labels=["rollout 0", *("actor_fwd" for _ in fwd)],
        )

    def _named_roles(self) -> list[tuple[str, Any]]:
        """Every role actor by health name (relax_hpc/ops/health.py)."""
        return [("rollout", self._rollout), *zip(self._queue_role_names, self._queue_roles),
                *((f"trainer_rank_{rank}", a) for rank, a in enumerate(self._actors)),
                *((engine_role_name(f"engine-{i}"), e) for i, e in enumerate(self._engines))]

    def _start_heartbeats(self) -> None:
        assert self._healer is not None
        healer, interval = self._healer, self._healer.cfg.heartbeat_s
        named = self._named_roles()
        get_from_roles([(name, handle.start_heartbeat.remote(str(healer.job_dir), name, interval))
                        for name, handle in named], "starting its heartbeat", STATUS_TIMEOUT_S)
        for name, _ in named:
            healer.watch(name)

    def _restart_queue_role(self, index: int) -> None:
        """A new worker for queue role `index` under the same consumer id: it gets the rows its
        predecessor received but never acked, and every row after them (transfer/queue.py)."""
        import ray

        name, cfg = self._queue_role_names[index], self._queue_role_cfgs[index]
        ray.kill(self._queue_roles[index])
        self._probes.pop(name, None)
        worker = place_queue_role(cfg)
        self._queue_roles[index] = worker
        get_from_roles([(name, worker.weight_version.remote())], "restarting (loading its model)", ROLE_START_TIMEOUT_S)
        get_from_roles([(name, worker.start.remote(self.queue_address, self._next_uncleared, self._total_steps,
                                                   start_version=self._start_version))],
                       "restarting its loop", STATUS_TIMEOUT_S)
        if self._healer is not None:  # its heartbeat file names the new process once it is back at work
            get_from_roles([(name, worker.start_heartbeat.remote(str(self._healer.job_dir), name,
                                                                  self._healer.cfg.heartbeat_s))],
                           "starting its heartbeat", STATUS_TIMEOUT_S)
            self._healer.watch(name)
        log.info("%s restarted in place from step %d", name, self._next_uncleared)

    def _all(self, doing: str, timeout_s: float, method: str, *args: Any) -> list[Any]:
        calls = [(f"trainer rank {rank}", getattr(a, method).remote(*args)) for rank, a in enumerate(self._actors)]
        return get_from_roles(calls, doing, timeout_s)

    def _rollout_call(self, doing: str, method: str, *args: Any) -> Any:
        return get_from_roles([("rollout", getattr(self._rollout, method).remote(*args))], doing, STATUS_TIMEOUT_S)[0]

    def _queue_roles_call(self, doing: str, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        calls = [(name, getattr(f, method).remote(*args, **kwargs))
                 for name, f in zip(self._queue_role_names, self._queue_roles)]
        return get_from_roles(calls, doing, STATUS_TIMEOUT_S)

    def start_rollout(self, start_step: int, total_steps: int, max_staleness: int, start_version: int) -> None:
        self._total_steps = total_steps
        self._next_uncleared, self._start_version = start_step, start_version
        self.weights.connect()  # before any step is queued on the trainer: it opens the channel
        self._rollout_call("starting its producer", "start_producer", self.queue_address, start_step, total_steps,
                           max_staleness, start_version)
        self._queue_roles_call("starting its loop", "start", self.queue_address, start_step, total_steps,
                               start_version=start_version)

    def _errors(self) -> str | None:
        """The producing roles' errors, polled while a step trains. With a healer, first the
        roles' health: a stale role or a dead queue role or engine is restarted in place, or
        the run restarts globally (GlobalRestartNeeded); a dead rollout is a RoleDiedError."""
        if self._healer is not None:
            self._check_health()
        found = [self._probe("rollout", lambda: self._rollout.producer_error.remote())]
        for index, (name, worker) in enumerate(zip(self._queue_role_names, self._queue_roles)):
            try:
                found.append(self._probe(name, lambda worker=worker: worker.error.remote()))
            except RoleDiedError as e:
                if self._healer is None:
                    raise
                self._healer.failed(name, "died", short_cause(e),
                                    restart=lambda index=index: self._restart_queue_role(index))
        return "; ".join(e for e in found if e) or None

    def _probe(self, name: str, call: Callable[[], Any]) -> str | None:
        """A role's error report, if it answers within PROBE_WAIT_S; else None for now (the
        same call is waited for at the next poll)."""
        import ray

        ref = self._probes.pop(name, None) or call()
        ready, _ = ray.wait([ref], timeout=PROBE_WAIT_S)
        if not ready:
            self._probes[name] = ref
            return None
        return get_from_roles([(name, ref)], "reporting its errors", 0.0)[0]

    def _check_health(self, engines_now: bool = False) -> None:
        """Stale roles, then (every heartbeat_s while a step is polled, or `engines_now`) the
        engines."""
        assert self._healer is not None
        healer = self._healer
        for role in healer.stale_roles():
            detail = f"no heartbeat for {healer.stale.silent_for(role) if role in healer.stale.roles() else healer.cfg.stale_s:.0f} s"
            if role in self._queue_role_names:
                index = self._queue_role_names.index(role)
                healer.failed(role, "stopped answering", detail,
                              restart=lambda index=index: self._restart_queue_role(index))
            elif role.startswith("engine_"):
                engine_id = role.replace("_", "-")
                healer.forget(role)  # killed now; its death is handled like any dead engine below
                self._rollout_call(f"killing the hung engine {engine_id}", "kill_engine", engine_id)
            else:
                healer.failed(role, "stopped answering", detail)  # a core role: raises
        if engines_now or time.monotonic() - self._last_engine_check >= healer.cfg.heartbeat_s:
            self._last_engine_check = time.monotonic()
            self._heal_engines()

    def _heal_engines(self) -> None:
        """A rollout engine of this job that died is replaced by a new one (an elastic
        scale-out of one engine); its prompts were already re-issued by the router."""
        assert self._healer is not None
        for engine in self.engine_report():
            if engine["state"] != "failed" or engine["job"] is not None or engine["id"] in self._seen_failed_engines:
                continue
            role = engine_role_name(engine["id"])
            self._healer.failed(role, "died", "its prompts went to the other engines",
                                restart=lambda: self._replace_engine(engine["id"]))
            self._healer.replaced(role)  # a new engine (another id) joins in its place
            self._seen_failed_engines.add(engine["id"])

    def _replace_engine(self, engine_id: str) -> None:
        reply = self.elastic("scale_out", {"num_engines": 1})
        if reply.status >= 300:
            raise RuntimeError(f"could not start a replacement for engine {engine_id}: {reply.body}")
        log.info("engine %s died; a replacement joins: %s", engine_id, reply.body)

    def start_train(self, step: int, publish_version: int) -> TrainTicket:
        # Each rank asks for its first rows of the next step now, so they are on their way by
        # the time this step ends (when rollout runs ahead, they are usually there already).
        # Rank 0 starts the broadcast of the trained weights itself; the receivers are posted
        # once the step is back (`published`), after the previous broadcast was waited for.
        after = step + 1 if step + 1 < self._total_steps else None
        refs = [a.train_from_queue.remote(self.queue_address, step, self.timeout_s, after, publish_version)
                for a in self._actors]
        self._ticket = _RayTicket(refs, self._errors, publish=lambda: self.weights.expect(publish_version),
                                  doing=f"training step {step}")
        return self._ticket

    def clear_step(self, step: int) -> None:
        # The driver clears through its own client: every trainer rank has acked its rows by
        # now, and a rollout held by the staleness bound waits for this clear.
        self._queue.clear(partition_name(step))
        self._next_uncleared = step + 1

    def step_report(self, step: int) -> tuple[dict[str, float], dict]:
        if self._healer is not None:  # once a step too: short steps end before the ticket polls
            self._check_health(engines_now=True)
        stats, cursor = self._rollout_call(f"reporting step {step}", "step_report", step)
        if self._healer is not None:
            stats = {**stats, **self._healer.book.metrics()}
        return stats, cursor

    def save_checkpoint(self, state: ResumeState) -> str:
        return self._all(f"saving the checkpoint of step {state.step}", CHECKPOINT_TIMEOUT_S,
                         "save_checkpoint", state)[0]

    def load_checkpoint(self) -> ResumeState | None:
        return self._all("loading the newest checkpoint", CHECKPOINT_TIMEOUT_S, "load_checkpoint")[0]

    def restore_cursor(self, state: dict) -> None:
        self._rollout_call("restoring the data cursor", "restore_cursor", state)

    def dataset_summary(self) -> str:
        return self._rollout_call("summarizing the dataset", "dataset_summary")

    def engine_report(self) -> list[dict[str, Any]]:
        return self._rollout_call("reporting its engines", "engine_report")

    def memory_report(self) -> list[dict[str, Any]]:
        trainer = self._all("reporting the bytes it holds", STATUS_TIMEOUT_S, "memory_record")
        engines = get_from_roles([(f"rollout engine {i}", e.memory_record.remote(i)) for i, e in enumerate(self._engines)],
                                 "reporting the bytes it holds", STATUS_TIMEOUT_S)
        return [*trainer, self._rollout_call("reporting the bytes it holds", "memory_record"), *engines]

    def elastic(self, action: str, body: dict[str, Any]) -> ElasticReply:
        return self._rollout_call(f"answering the elastic request {action!r}", "elastic", action, body)

    def engine_pids(self) -> list[int]:
        """The process ids of the engine actors (tests kill one to check nothing is lost)."""
        calls = [(f"rollout engine {i}", e.pid.remote()) for i, e in enumerate(self._engines)]
        return get_from_roles(calls, "reporting its pid", STATUS_TIMEOUT_S)

    def trainer_pids(self) -> list[int]:
        """The process ids of the trainer ranks, by rank (tests kill one mid-step)."""
        return list(self._trainer_pids)

    def shutdown(self, abandon: bool = False) -> None:
        """Stop every role: politely (stop, close the channel), then kill; `abandon`: kill at
        once (a global restart: a hung role would not answer the polite part). Engines that
        rollout started at run time are its own actors: Ray ends them with it."""
        import ray

        try:
            if not abandon:
                self._stop_politely()
        finally:
            for a in [*self._actors, self._rollout, *self._engines, *self._queue_roles]:
                ray.kill(a)
            self._queue.close()
            self._server.stop()

    def _stop_politely(self) -> None:
        try:
            calls = [("rollout", self._rollout.stop_producer.remote()),
                     *((name, f.stop.remote()) for name, f in zip(self._queue_role_names, self._queue_roles))]
            get_from_roles(calls, "stopping", STATUS_TIMEOUT_S)
            # A trainer still inside a step (the loop failed) would answer only after its queue
            # timeout: it is killed without the polite part.
            if self._ticket is None or self._ticket.done:
                self.weights.close()
                self._all("shutting down", STATUS_TIMEOUT_S, "shutdown")
        except Exception as e:  # noqa: BLE001 - a role that already died; the loop's own error matters
            log.warning("roles did not shut down cleanly (%s: %s); killing them", type(e).__name__, e)


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
