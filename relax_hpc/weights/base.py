"""The weight-sync interface: how new trainer weights reach the rollout engines.

`WeightSync.sync(version)` returns once every receiver has `version` (engines swap it in at their
next batch boundary). Implementations: `InProcessWeightSync` (objects in one process: in-process
runs and tests) and `relax_hpc.weights.ray_sync.DistributedWeightSync` (Ray actors: the bucketed
gloo / NCCL broadcast channel, see docs/weights.md).
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
