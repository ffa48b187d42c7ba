"""`[federation]`: the driver grows its own job when rollout is the bottleneck (docs/federation.md).

The policy is pure: it sees each step's metrics and says what to do; `GrowDriver` carries that
out through a `GrowSubmitter` (Slurm, from the launch layer; a fake in tests) and the rollout
role's elastic API. One grow job at a time, at most one kept:

    watching   a full window in which the trainer waited longer for rows than it computed
               (time/queue_wait_s > time/train_s - time/queue_wait_s): submit a grow job of
               max_engines engines, remember the window's mean step time -> joining
    joining    its engines serve (rollout/engines_by_job/<grow job> > 0) -> measuring
    measuring  after a window: steps at least min_step_gain faster -> kept; else drain its
               engines, cancel it, and grow no more -> stopped
    kept       its engines are all gone (pre-empted, cancelled, shrunk) -> watching again
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

from relax_hpc.engines.elastic.api import ElasticReply
from relax_hpc.spec.schema import FederationSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrowDecision:
    kind: str  # "grow" | "drop"
    engines: int = 0  # grow: how many
    grow_job: str | None = None  # drop: which
    reason: str = ""


@dataclass
class GrowPolicy:
    """See the module docstring; `observe` once per step, in order."""

    spec: FederationSpec
    phase: str = "watching"
    grow_job: str | None = None
    baseline_step_s: float | None = None
    window: list[dict[str, float]] = field(default_factory=list)

    def observe(self, m: dict[str, float]) -> GrowDecision | None:
        size = self.spec.window_steps
        if self.phase in ("stopped", "submitting"):
            return None
        if self.phase == "joining":
            if self._serving(m):
                self.phase, self.window = "measuring", []
            return None
        if self.phase == "kept":
            if not self._serving(m):
                log.info("the engines of grow job %s are gone; watching rollout again", self.grow_job)
                self.phase, self.grow_job, self.window = "watching", None, []
            return None
        self.window = (self.window + [m])[-size:]
        if len(self.window) < size:
            return None
        step_s = _mean(self.window, "time/step_s")
        if self.phase == "watching":
            wait = _mean(self.window, "time/queue_wait_s")
            own = _mean(self.window, "time/train_s") - wait
            if wait <= own:
                return None
            self.phase, self.baseline_step_s, self.window = "submitting", step_s, []
            return GrowDecision("grow", engines=self.spec.max_engines, reason=(
                f"the trainer waited {wait:.3f} s a step for rows and computed {own:.3f} s: rollout is the bottleneck"))
        assert self.baseline_step_s is not None  # measuring
        gain = self.baseline_step_s / step_s - 1.0
        if gain >= self.spec.min_step_gain:
            self.phase = "kept"
            log.info("grow job %s kept: steps %.0f%% faster (%.3f -> %.3f s)", self.grow_job, 100 * gain,
                     self.baseline_step_s, step_s)
            return None
        self.phase = "stopped"
        return GrowDecision("drop", grow_job=self.grow_job, reason=(
            f"steps only {100 * gain:.0f}% faster with its engines ({self.baseline_step_s:.3f} -> {step_s:.3f} s; "
            f"[federation] min_step_gain = {self.spec.min_step_gain:g})"))

    def submitted(self, grow_job: str | None) -> None:
        """The grow job's id, or None when it could not be submitted (the policy stops)."""
        self.grow_job = grow_job
        self.phase = "joining" if grow_job is not None else "stopped"

    def _serving(self, m: dict[str, float]) -> bool:
        return m.get(f"rollout/engines_by_job/{self.grow_job}", 0.0) > 0


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows) / len(rows)


class GrowSubmitter(Protocol):
    """Submits and cancels this job's grow jobs (launch/federation.py's SlurmGrowSubmitter)."""

    def submit(self, engines: int) -> str: ...

    def cancel(self, grow_job: str) -> None: ...


class ElasticTarget(Protocol):
    def elastic(self, action: str, body: dict[str, Any]) -> ElasticReply: ...


class GrowDriver:
    """Feeds the policy each step and carries out its decisions; never fails the run (a grow that
    cannot be done is reported, and the policy stops)."""

    def __init__(self, spec: FederationSpec, submitter: GrowSubmitter, rollout: ElasticTarget) -> None:
        self.policy = GrowPolicy(spec)
        self.submitter, self.rollout = submitter, rollout
        self.events: list[str] = []  # what it did, in order (also printed)

    def on_step(self, step: int, m: dict[str, float]) -> None:
        decision = self.policy.observe(m)
        if decision is None:
            return
        try:
            if decision.kind == "grow":
                grow_job = self.submitter.submit(decision.engines)
                self.policy.submitted(grow_job)
                self._say(f"step {step}: submitted grow job {grow_job} ({decision.engines} engines): {decision.reason}")
            else:
                assert decision.grow_job is not None
                reply = self.rollout.elastic("scale_in", {"job": decision.grow_job})
                self.submitter.cancel(decision.grow_job)
                self._say(f"step {step}: gave grow job {decision.grow_job} back (scale_in {reply.status}): "
                          f"{decision.reason}")
        except Exception as e:  # the run goes on with the engines it has
            if decision.kind == "grow":
                self.policy.submitted(None)
            self._say(f"step {step}: [federation] could not {decision.kind} ({type(e).__name__}: {e}); the run goes "
                      "on without growing")

    def _say(self, message: str) -> None:
        self.events.append(message)
        print(f"[federation] {message}", file=sys.stderr, flush=True)
