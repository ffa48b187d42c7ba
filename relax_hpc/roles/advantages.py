"""The Advantages role: group-relative advantages written onto each step's queued rows.

With `[train] advantages_role = true` rollout puts rows with `rewards` and `group_id` but no
`advantages`; this worker reads each step's rows, computes the advantage of every row from the
rewards of its group (samples sharing a `group_id`) by `[algorithm] advantage`
(relax_hpc/algos/estimators.py; the whitened ones also read each row's `loss_mask`, for its
trained tokens) and writes `advantages` back. The trainer
asks for `advantages` among its fields, so it waits for them (the queue wakes a consumer when
another role writes the field it lacks).

A group's advantage needs all of its members, and agent sessions export a varying number of
samples per group, so the worker takes a step's rows only once the partition is complete (one
`get` of the whole step) and acks them all in one call after writing: a worker killed before
that ack is restarted under the same consumer id, gets the whole step again and writes the same
values (the computation is deterministic), so nothing is lost or counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from relax_hpc.algos.advantages import normalizes_std
from relax_hpc.algos.estimators import WHITENED_ESTIMATORS, outcome_advantages
from relax_hpc.roles.heartbeat import Heartbeats
from relax_hpc.roles.step_loop import StepLoopWorker
from relax_hpc.spec.schema import AlgorithmSpec
from relax_hpc.transfer.queue import partition_name

INPUT_FIELDS = ("rewards", "group_id")
OUTPUT_FIELD = "advantages"
# A whole step in one batch: the server hands it out when the partition is complete.
WHOLE_STEP = 1 << 30


def divides_by_std(algorithm: AlgorithmSpec) -> bool:
    """Whether group advantages are divided by the group's std: `[algorithm] normalize_std`,
    unless the algorithm never does (Dr.GRPO's)."""
    return algorithm.normalize_std and normalizes_std(algorithm.name)


@dataclass(frozen=True)
class AdvantagesConfig:
    """The Advantages role: the [algorithm] table it reads (`advantage`, `normalize_std`, `name`)."""

    algorithm: AlgorithmSpec
    kind: str = "advantages"  # the queue task name, and how the role handles tell it apart


class AdvantagesWorker(StepLoopWorker, Heartbeats):
    """One Advantages worker; `start` runs its loop over steps in a background thread."""

    def __init__(self, cfg: AdvantagesConfig) -> None:
        super().__init__(cfg.kind)
        self.cfg = cfg
        self._fields = INPUT_FIELDS + (("loss_mask",) if cfg.algorithm.advantage in WHITENED_ESTIMATORS else ())

    def weight_version(self) -> int:
        """Advantages need no model: always 0 (the role handles ask every worker once it is up)."""
        return 0

    def _process(self, queue: Any, step: int) -> bool:
        """Write `advantages` on every row of one step; False when asked to stop."""
        partition = partition_name(step)
        while not self._stop.is_set():
            try:
                batch = queue.get(partition, self.cfg.kind, self._fields, WHOLE_STEP, timeout=1.0)
            except TimeoutError:
                continue
            if batch.rows:
                rewards = torch.tensor([float(r) for r in batch.column("rewards")])  # type: ignore[arg-type]
                groups = [int(g) for g in batch.column("group_id")]  # type: ignore[arg-type]
                trained = (torch.tensor([float(sum(m)) for m in batch.column("loss_mask")])  # type: ignore[arg-type]
                           if "loss_mask" in self._fields else torch.zeros(len(groups)))
                values = outcome_advantages(self.cfg.algorithm.advantage, rewards, groups, trained,
                                            divides_by_std(self.cfg.algorithm)).tolist()
                queue.write(partition, batch.indices, [{OUTPUT_FIELD: v} for v in values])
                queue.ack(partition, self.cfg.kind, batch.indices)
                self.rows_done += len(batch.indices)
            if batch.end:
                return True
        return False
