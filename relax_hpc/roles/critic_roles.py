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

import time
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


class _CriticTicket:
    """The critic's step, then the trainer's (None during the warm-up: `publish` sends the
    unchanged weights instead)."""

    def __init__(self, critic: Callable[[], dict[str, float]], actor: TrainTicket | None,
                 publish: Callable[[], PendingWeights]) -> None:
        self._critic, self._actor, self._publish = critic, actor, publish
        self._published: PendingWeights | None = None
        self.done = False

    def result(self) -> dict[str, float]:
        critic = self._critic()
        if self._actor is None:
            t0 = time.perf_counter()
            self._published = self._publish()
            stats = {**critic, "sync_s": time.perf_counter() - t0, "critic/warmup": 1.0}
        else:
            stats = {**self._actor.result(), **{k: v for k, v in critic.items() if k.startswith("critic/")},
                     "critic/warmup": 0.0}
        self.done = True
        return stats

    def published(self) -> PendingWeights:
        if self._actor is not None:
            return self._actor.published()
        if self._published is None:
            raise RuntimeError("published() before result(): the step has not trained yet")
        return self._published


class CriticRoles:
    """`inner`'s roles and a critic; every call it does not define goes to `inner`."""

    def __init__(self, inner: LocalRoles | RayRoles, cfg: CriticConfig) -> None:
        self.inner = inner
        self.weights = inner.weights
        self.cfg = cfg
        self._local = isinstance(inner, LocalRoles)
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
        actor = None if warm else self.inner.start_train(step, publish_version)
        return _CriticTicket(critic, actor, lambda: self._publish_unchanged(publish_version))

    def _publish_unchanged(self, version: int) -> PendingWeights:
        """The trainer's weights, untouched during the warm-up, sent as `version`."""
        if self._local:
            return self.weights.start(version)
        actors = getattr(self.inner, "_actors")
        get_from_roles([("trainer rank 0", actors[0].start_send_weights.remote(version))],
                       "starting the broadcast of its weights", STATUS_TIMEOUT_S)
        return self.weights.expect(version)  # type: ignore[attr-defined]

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
