"""`CriticRoles`: the role handles of a PPO run, the driver's `Roles` with a critic beside them.

It wraps `LocalRoles` or `RayRoles` (roles/handles.py) and adds the Critic role
(roles/critic.py): each `start_train(step)` submits the critic's step together with the
trainer's, and the step's result carries the critic's metrics. During `[critic] warmup_steps`
only the critic trains: the trainer's step is not submitted, and rank 0 broadcasts its unchanged
weights as the step's version, so rollout's staleness rule and the weight versions go on as in any
step. A checkpoint saves the critic first, then the actor (`checkpoints_critic/step_N`, beside
`checkpoints/`); a resume loads the critic at the step the actor resumes from. A critic that dies
is a dead role like a trainer rank (`RoleDiedError`): the run restarts globally.

On Ray the critic's `[critic] num_processes` ranks are actors on the forward component when the
cluster has one, else on the trainer's, each with one GPU when the trainer runs on CUDA, placed
like the trainer's ranks (rank 0 pinned to the node that hosts their group's store). Every call
goes to every rank (they are collective); rank 0 answers for them. In one process (`LocalRoles`)
the critic is one rank, as the trainer is.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from relax_hpc.ckpt import ResumeState
from relax_hpc.roles.critic import CriticConfig, CriticWorker
from relax_hpc.roles.handles import LocalRoles, RayRoles, Roles, TrainTicket
from relax_hpc.roles.placement import gpus, place_ranks
from relax_hpc.roles.supervision import (
    CHECKPOINT_TIMEOUT_S,
    ROLE_START_TIMEOUT_S,
    STATUS_TIMEOUT_S,
    get_from_roles,
    guarded_step,
    result_of,
)
from relax_hpc.weights.base import PendingWeights

CRITIC_ROLE = "critic"
log = logging.getLogger(__name__)


class _DeferredTrain:
    """A trainer step submitted when `submit` is first called: after a warm-up step the trainer's
    next calls must queue behind the broadcast of its unchanged weights, which the loop posts only
    once the warm-up step's result is back (`_CriticTicket.published`)."""

    def __init__(self, submit: Callable[[], TrainTicket]) -> None:
        self._submit = submit
        self.ticket: TrainTicket | None = None

    def submit(self) -> TrainTicket:
        if self.ticket is None:
            self.ticket = self._submit()
        return self.ticket


class _CriticTicket:
    """The critic's step, then the trainer's (None during the warm-up: `publish` sends the
    unchanged weights instead). `flush` submits the trainer steps deferred up to this one."""

    def __init__(self, critic: Callable[[], dict[str, float]], actor: _DeferredTrain | None,
                 publish: Callable[[], PendingWeights], flush: Callable[[], None]) -> None:
        self._critic, self._actor, self._publish, self._flush = critic, actor, publish, flush
        self._published: PendingWeights | None = None
        self.done = False

    def result(self) -> dict[str, float]:
        if self._actor is not None:  # a warm-up step's own broadcast is posted after its result
            self._flush()
        critic = self._critic()
        if self._actor is None:
            stats = {**critic, "critic/warmup": 1.0}
        else:
            stats = {**self._actor.submit().result(), **{k: v for k, v in critic.items() if k.startswith("critic/")},
                     "critic/warmup": 0.0}
        self.done = True
        return stats

    def published(self) -> PendingWeights:
        if self._actor is not None:
            return self._actor.submit().published()
        if not self.done:
            raise RuntimeError("published() before result(): the step has not trained yet")
        if self._published is None:  # posted now, after the loop waited for the previous broadcast
            self._published = self._publish()
        return self._published


class CriticRoles:
    """`inner`'s roles and a critic; every call it does not define goes to `inner`."""

    def __init__(self, inner: LocalRoles | RayRoles, cfg: CriticConfig) -> None:
        self.inner = inner
        self.weights = inner.weights
        self.cfg = cfg
        self._local = isinstance(inner, LocalRoles)
        self._deferred: list[_DeferredTrain] = []
        if self._local:
            if cfg.table.num_processes > 1:
                log.warning("[critic] num_processes = %d: an in-process run holds one critic rank (and one "
                            "trainer rank); run on Ray for several", cfg.table.num_processes)
            self._critic: Any = CriticWorker(cfg)
            self._target: Any = inner.queue
        else:
            self._ranks = _place_critic(cfg)
            self._critic = self._ranks[0]
            self._target = inner.queue_address
            get_from_roles([(_rank_name(r, len(self._ranks)), a.weight_version.remote())
                            for r, a in enumerate(self._ranks)],
                           "starting (placed by Ray, loading its model)", ROLE_START_TIMEOUT_S)
            healer = getattr(inner, "_healer", None)
            if healer is not None:
                names = [_rank_name(r, len(self._ranks)).replace(" ", "_") for r in range(len(self._ranks))]
                get_from_roles([(name, a.start_heartbeat.remote(str(healer.job_dir), name, healer.cfg.heartbeat_s))
                                for name, a in zip(names, self._ranks)], "starting its heartbeat", STATUS_TIMEOUT_S)
                for name in names:
                    healer.watch(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def start_train(self, step: int, publish_version: int) -> TrainTicket:
        warm = step < self.cfg.table.warmup_steps
        errors: Callable[[], str | None] = getattr(self.inner, "_errors")
        if self._local:
            critic = lambda: guarded_step(errors, lambda: self._critic.train_step(self._target, step))  # noqa: E731
        else:
            refs = [a.train_step.remote(self._target, step) for a in self._ranks]
            critic = lambda: _wait_polling(refs, errors, f"critic step {step}")  # noqa: E731
        actor = None
        if not warm:
            actor = _DeferredTrain(lambda: self.inner.start_train(step, publish_version))
            if self._deferred or (0 < step == self.cfg.table.warmup_steps):
                self._deferred.append(actor)  # behind the warm-up's broadcast: submitted by `_flush`
            else:
                actor.submit()
        return _CriticTicket(critic, actor, lambda: self._publish_unchanged(publish_version), self._flush)

    def _flush(self) -> None:
        """Submit the deferred trainer steps, in order (the warm-up's broadcast is posted by now)."""
        while self._deferred:
            self._deferred.pop(0).submit()

    def _publish_unchanged(self, version: int) -> PendingWeights:
        """The trainer's weights, untouched during the warm-up, sent as `version`. On Ray rank 0
        starts the broadcast itself, as after a trained step: the receivers' side is what the loop
        waits for, never the sender's, whose next broadcast may already be under way."""
        if self._local:
            return self.weights.start(version)
        pending = self.weights.expect(version)  # type: ignore[attr-defined]
        actors = getattr(self.inner, "_actors")
        get_from_roles([("trainer rank 0", actors[0].start_send_weights.remote(version))],
                       "starting the broadcast of its weights", STATUS_TIMEOUT_S)
        return pending

    def save_checkpoint(self, state: ResumeState) -> str:
        self._call("save_checkpoint", f"saving the checkpoint of step {state.step}", CHECKPOINT_TIMEOUT_S, state.step)
        return self.inner.save_checkpoint(state)

    def load_checkpoint(self) -> ResumeState | None:
        state = self.inner.load_checkpoint()
        self._call("load_checkpoint", "loading its checkpoint", CHECKPOINT_TIMEOUT_S,
                   None if state is None else state.step)
        return state

    def memory_report(self) -> list[dict[str, Any]]:
        if self._local:
            return [*self.inner.memory_report(), self._critic.memory_record()]
        return [*self.inner.memory_report(), *self._all("memory_record", "reporting the bytes it holds",
                                                        STATUS_TIMEOUT_S)]

    def critic_pid(self) -> int:
        """The critic's process id (the fault suite kills it)."""
        return int(self._call("pid", "reporting its pid", STATUS_TIMEOUT_S))

    def shutdown(self, abandon: bool = False) -> None:
        try:
            if self._local:
                self._critic.shutdown()
            else:
                import ray

                for rank in self._ranks:
                    ray.kill(rank)
        finally:
            self.inner.shutdown(abandon=abandon)

    def _call(self, method: str, doing: str, timeout_s: float, *args: Any) -> Any:
        """`method` on every rank (saving and loading are collective); rank 0's answer."""
        if self._local:
            return getattr(self._critic, method)(*args)
        return self._all(method, doing, timeout_s, *args)[0]

    def _all(self, method: str, doing: str, timeout_s: float, *args: Any) -> list[Any]:
        calls = [(_rank_name(r, len(self._ranks)), getattr(a, method).remote(*args)) for r, a in enumerate(self._ranks)]
        return get_from_roles(calls, doing, timeout_s)


def with_critic(inner: Roles, cfg: CriticConfig | None) -> Roles:
    """`inner` itself, or with the critic `cfg` describes (advantage = "gae")."""
    if cfg is None:
        return inner
    assert isinstance(inner, (LocalRoles, RayRoles))
    return CriticRoles(inner, cfg)  # type: ignore[return-value]


def _rank_name(rank: int, ranks: int) -> str:
    """How a critic rank is named in errors and health files: "critic" when it is the only one."""
    return CRITIC_ROLE if ranks == 1 else f"{CRITIC_ROLE} rank {rank}"


def _place_critic(cfg: CriticConfig) -> list[Any]:
    """The critic's ranks, by rank: on the forward component when the cluster has one, else the trainer's.
    One call at a time, in order (as the trainer's): step N+1's values need the critic trained on N."""
    import ray

    component = "forward" if ray.cluster_resources().get("forward", 0) > 0 else "trainer"
    return place_ranks(CriticWorker, cfg, cfg.table.num_processes, component, gpus(cfg.device), CRITIC_ROLE)


def _wait_polling(refs: list[Any], errors: Callable[[], str | None], doing: str,
                  poll_s: float = 1.0) -> dict[str, float]:
    """The critic's step result (rank 0's: every rank returns the whole step's statistics); a rank
    that dies or fails, or a producing role's failure (polled while it waits), ends it at once."""
    import ray

    calls = [(_rank_name(rank, len(refs)), ref) for rank, ref in enumerate(refs)]
    results: dict[Any, dict[str, float]] = {}
    pending = list(refs)
    while True:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
        for ref in ready:  # a rank that died or failed raises at once; a peer's death before its own failure
            results[ref] = result_of(calls, ref, doing, results)
        if not pending:
            return results[refs[0]]
        error = errors()
        if error:
            raise RuntimeError(f"{error} (the critic was waiting for that step's rows)")
