"""Role handles: what the driver calls. Each hides where its role runs (Ray actors or in process).

`RayRoles` places one Rollout actor and `train.num_processes` Actor ranks on the Ray cluster;
`LocalRoles` runs the same workers in this process (fast tests, debugging).
"""

from __future__ import annotations

import socket
from typing import Any, Protocol

from relax_hpc.ckpt import ResumeState
from relax_hpc.data.sample import Sample
from relax_hpc.roles.actor import ActorConfig, ActorWorker
from relax_hpc.roles.rollout import RolloutConfig, RolloutWorker
from relax_hpc.weights.base import InProcessWeightSync, RayObjectStoreWeightSync, WeightSync


class Roles(Protocol):
    weights: WeightSync

    def generate(self, step: int) -> tuple[list[Sample], dict[str, float]]: ...
    def train(self, samples: list[Sample]) -> dict[str, float]: ...
    def save_checkpoint(self, state: ResumeState) -> str: ...
    def load_checkpoint(self) -> ResumeState | None: ...
    def cursor_state(self) -> dict: ...
    def restore_cursor(self, state: dict) -> None: ...
    def dataset_summary(self) -> str: ...
    def shutdown(self) -> None: ...


def shard(samples: list[Sample], parts: int) -> list[list[Sample]]:
    """Split into `parts` contiguous shards of (nearly) equal size, keeping order."""
    size, extra = divmod(len(samples), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (1 if i < extra else 0)
        out.append(samples[start:stop])
        start = stop
    return out


def mean_stats(all_stats: list[dict[str, float]]) -> dict[str, float]:
    keys = all_stats[0].keys()
    return {k: sum(s[k] for s in all_stats) / len(all_stats) for k in keys}


class LocalRoles:
    """Every role in this process (one trainer rank)."""

    def __init__(self, rollout: RolloutConfig, actor: ActorConfig) -> None:
        self.rollout = RolloutWorker(rollout)
        self.actor = ActorWorker(actor)
        self.weights: WeightSync = InProcessWeightSync(self.actor, [self.rollout])

    def generate(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        return self.rollout.generate(step)

    def train(self, samples: list[Sample]) -> dict[str, float]:
        return self.actor.train(samples)

    def save_checkpoint(self, state: ResumeState) -> str:
        return self.actor.save_checkpoint(state)

    def load_checkpoint(self) -> ResumeState | None:
        return self.actor.load_checkpoint()

    def cursor_state(self) -> dict:
        return self.rollout.cursor_state()

    def restore_cursor(self, state: dict) -> None:
        self.rollout.restore_cursor(state)

    def dataset_summary(self) -> str:
        return self.rollout.dataset_summary()

    def shutdown(self) -> None:
        self.actor.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayRoles:
    """Rollout and Actor ranks as Ray actors, placed by component resources when the cluster has them."""

    def __init__(self, rollout: RolloutConfig, actor: ActorConfig, num_processes: int) -> None:
        import ray

        rollout_opts = self._placement("rollout")
        trainer_opts = self._placement("trainer")
        self._rollout = ray.remote(RolloutWorker).options(name=None, **rollout_opts).remote(rollout)
        # Rank 0's node hosts the TCP store; on one machine that is loopback.
        master = f"127.0.0.1:{_free_port()}"
        self._actors = [
            ray.remote(ActorWorker).options(**trainer_opts).remote(actor, rank, num_processes, master)
            for rank in range(num_processes)
        ]
        self.weights: WeightSync = RayObjectStoreWeightSync(self._actors[0], [self._rollout])
        ray.get(self._rollout.weight_version.remote())  # surfaces construction errors now

    @staticmethod
    def _placement(component: str) -> dict[str, Any]:
        import ray

        if ray.cluster_resources().get(component, 0) > 0:
            return {"num_cpus": 0, "resources": {component: 0.01}}
        return {"num_cpus": 0}

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(a, method).remote(*args) for a in self._actors])

    def generate(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        import ray

        return ray.get(self._rollout.generate.remote(step))

    def train(self, samples: list[Sample]) -> dict[str, float]:
        import ray

        shards = shard(samples, len(self._actors))
        return mean_stats(ray.get([a.train.remote(s) for a, s in zip(self._actors, shards)]))

    def save_checkpoint(self, state: ResumeState) -> str:
        return self._all("save_checkpoint", state)[0]

    def load_checkpoint(self) -> ResumeState | None:
        return self._all("load_checkpoint")[0]

    def cursor_state(self) -> dict:
        import ray

        return ray.get(self._rollout.cursor_state.remote())

    def restore_cursor(self, state: dict) -> None:
        import ray

        ray.get(self._rollout.restore_cursor.remote(state))

    def dataset_summary(self) -> str:
        import ray

        return ray.get(self._rollout.dataset_summary.remote())

    def shutdown(self) -> None:
        import ray

        try:
            self._all("shutdown")
        finally:
            for a in [*self._actors, self._rollout]:
                ray.kill(a)
