"""The weight-sync interface: how new trainer weights reach the rollout engines, and when they must.

`WeightSync.start(version)` snapshots the trainer's weights and begins moving them; the handle's
`wait()` returns once every receiver holds `version` (engines swap it in at their next batch
boundary) and raises the channel's error otherwise. `sync(version)` is `start(version).wait()`.
The training loop starts the broadcast of a step's weights and trains the next step while the
bytes move; `required_weight_version` is what keeps that from loosening the staleness bound:
rollout (and ActorFwd) wait at their batch boundary until a complete update of that version
has arrived.

Implementations: `InProcessWeightSync` (objects in one process: in-process runs and tests) and
`relax_hpc.weights.ray_sync.DistributedWeightSync` (Ray actors: the bucketed gloo / NCCL
broadcast channel, see docs/weights.md).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence


class PendingWeights(Protocol):
    """A started weight update; `wait()` returns when every receiver holds it, or raises why not."""

    version: int

    def wait(self) -> None: ...


class WeightSync(Protocol):
    def start(self, version: int) -> PendingWeights: ...
    def sync(self, version: int) -> None: ...


def required_weight_version(step: int, start_step: int, start_version: int, max_staleness: int) -> int:
    """The oldest weight version that may generate rollout step `step`.

    The loop trains step N into version start_version + (N - start_step) + 1, and rollout may
    start step s once step s - max_staleness - 1 is cleared, i.e. trained. So the synchronous
    loop (sync before clear) always gave step s at least the version trained on every step up to
    s - max_staleness - 1; with the broadcast overlapping training, rollout waits for it instead.
    ActorFwd, which must compute the log-probs of the weights a step starts with, uses
    max_staleness = 0.
    """
    return start_version + max(0, step - max_staleness - start_step)


class FinishedWeights:
    """The handle of an update that completed when it was started."""

    def __init__(self, version: int) -> None:
        self.version = version

    def wait(self) -> None:
        return None


class InProcessWeightSync:
    """Copy weights from a trainer object to receiver objects living in this process.

    The copy is cheap and receivers only stage it for their next batch boundary, so `start` does
    it at once and hands back a finished handle.
    """

    def __init__(self, trainer: Any, receivers: Sequence[Any]) -> None:
        self.trainer, self.receivers = trainer, list(receivers)

    def start(self, version: int) -> FinishedWeights:
        weights = self.trainer.export_weights()
        for r in self.receivers:
            r.update_weights(weights, version)
        return FinishedWeights(version)

    def sync(self, version: int) -> None:
        self.start(version).wait()
