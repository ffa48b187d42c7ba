"""The weight-sync interface: how new trainer weights reach the rollout engines.

`WeightSync.sync(version)` returns once every receiver runs `version`. Implementations:
`InProcessWeightSync` (objects in one process, for tests), `RayObjectStoreWeightSync` (the
trainer's weights go once through Ray's object store to every engine; the embedded default in
colocate mode). The bucketed torch.distributed broadcast channel implements the same interface:
`relax_hpc.weights.ray_sync.DistributedWeightSync` (see docs/weights.md).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class WeightSync(Protocol):
    def sync(self, version: int) -> None: ...


class InProcessWeightSync:
    """Copy weights from a trainer object to receiver objects living in this process."""

    def __init__(self, trainer: Any, receivers: Sequence[Any]) -> None:
        self.trainer, self.receivers = trainer, list(receivers)

    def sync(self, version: int) -> None:
        weights = self.trainer.export_weights()
        for r in self.receivers:
            r.update_weights(weights, version)


class RayObjectStoreWeightSync:
    """Rank 0 of the trainer exports its weights once; each rollout actor reads them from the object store."""

    def __init__(self, trainer_rank0: Any, receivers: Sequence[Any], timeout_s: float = 600.0) -> None:
        self.trainer, self.receivers, self.timeout_s = trainer_rank0, list(receivers), timeout_s

    def sync(self, version: int) -> None:
        import ray

        weights_ref = self.trainer.export_weights.remote()
        pending = {r.update_weights.remote(weights_ref, version): i for i, r in enumerate(self.receivers)}
        ready, not_ready = ray.wait(list(pending), num_returns=len(pending), timeout=self.timeout_s)
        if not_ready:
            late = sorted(pending[ref] for ref in not_ready)
            raise TimeoutError(
                f"weight sync to version {version}: rollout engine(s) {late} did not answer within "
                f"{self.timeout_s:.0f} s; check their logs under the job directory"
            )
        ray.get(ready)
