"""`CriticRoles`: the role handles of a PPO run, the driver's `Roles` with a critic beside them.

It wraps `LocalRoles` or `RayRoles` (roles/handles.py) and adds the Critic role
(roles/critic.py): each `start_train(step)` submits the critic's step together with the
trainer's, and the step's result carries the critic's metrics. During `[critic] warmup_steps`
only the critic trains: the trainer's step is not submitted, and rank 0 broadcasts its unchanged
weights as the step's version, so rollout's staleness rule and the weight versions go on as in any
step. A checkpoint saves the critic first, then the actor (`checkpoints_critic/step_N`, beside
`checkpoints/`); a resume loads the critic at the step the actor resumes from. A critic that dies
is a dead role like a trainer rank (`RoleDiedError`): the run restarts globally.

On Ray the critic is one actor on the trainer's component (or the forward component's when the
cluster has one), with one GPU when the trainer runs on CUDA.
"""

from __future__ import annotations

from typing import Any, Callable

from relax_hpc.ckpt import ResumeState
from relax_hpc.roles.critic import CriticConfig, CriticWorker
from relax_hpc.roles.handles import LocalRoles, RayRoles, Roles, TrainTicket
from relax_hpc.roles.placement import component_placement, gpus
from relax_hpc.roles.supervision import (
    CHECKPOINT_TIMEOUT_S,
    ROLE_START_TIMEOUT_S,
    STATUS_TIMEOUT_S,
    get_from_roles,
    guarded_step,
)
from relax_hpc.weights.base import PendingWeights

CRITIC_ROLE = "critic"


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
            self._critic: Any = CriticWorker(cfg)
            self._target: Any = inner.queue
        else:
            self._critic = _place_critic(cfg)
            self._target = inner.queue_address
            get_from_roles([(CRITIC_ROLE, self._critic.weight_version.remote())],
                           "starting (placed by Ray, loading its model)", ROLE_START_TIMEOUT_S)
            healer = getattr(inner, "_healer", None)
            if healer is not None:
                get_from_roles([(CRITIC_ROLE, self._critic.start_heartbeat.remote(
                    str(healer.job_dir), CRITIC_ROLE, healer.cfg.heartbeat_s))], "starting its heartbeat",
                    STATUS_TIMEOUT_S)
                healer.watch(CRITIC_ROLE)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def start_train(self, step: int, publish_version: int) -> TrainTicket:
        warm = step < self.cfg.warmup_steps
        errors: Callable[[], str | None] = getattr(self.inner, "_errors")
        if self._local:
            critic = lambda: guarded_step(errors, lambda: self._critic.train_step(self._target, step))  # noqa: E731
        else:
            ref = self._critic.train_step.remote(self._target, step)
            critic = lambda: _wait_polling(ref, errors, f"critic step {step}")  # noqa: E731
        actor = None
        if not warm:
            actor = _DeferredTrain(lambda: self.inner.start_train(step, publish_version))
            if self._deferred or (0 < step == self.cfg.warmup_steps):
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
        return [*self.inner.memory_report(), self._call("memory_record", "reporting the bytes it holds",
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

                ray.kill(self._critic)
        finally:
            self.inner.shutdown(abandon=abandon)

    def _call(self, method: str, doing: str, timeout_s: float, *args: Any) -> Any:
        if self._local:
            return getattr(self._critic, method)(*args)
        return get_from_roles([(CRITIC_ROLE, getattr(self._critic, method).remote(*args))], doing, timeout_s)[0]


def with_critic(inner: Roles, cfg: CriticConfig | None) -> Roles:
    """`inner` itself, or with the critic `cfg` describes (advantage = "gae")."""
    if cfg is None:
        return inner
    assert isinstance(inner, (LocalRoles, RayRoles))
    return CriticRoles(inner, cfg)  # type: ignore[return-value]


def _place_critic(cfg: CriticConfig) -> Any:
    import ray

    placement = component_placement("forward")
    if "resources" not in placement:
        placement = component_placement("trainer")
    # One call at a time, in order (as the trainer's): step N+1's values need the critic trained on N.
    return ray.remote(CriticWorker).options(**placement, **gpus(cfg.device)).remote(cfg)


def _wait_polling(ref: Any, errors: Callable[[], str | None], doing: str, poll_s: float = 1.0) -> dict[str, float]:
    """The critic's step result; a producing role's failure (polled while it waits) ends it at once."""
    import ray

    while True:
        ready, _ = ray.wait([ref], timeout=poll_s)
        if ready:
            return get_from_roles([(CRITIC_ROLE, ref)], doing, 0.0)[0]
        error = errors()
        if error:
            raise RuntimeError(f"{error} (the critic was waiting for that step's rows)")
