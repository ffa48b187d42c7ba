"""The Advantages role: group advantages written onto queued rows, a waiting trainer, restarts."""

from __future__ import annotations

import time

import pytest
import torch

from relax_hpc.algos.estimators import outcome_advantages
from relax_hpc.roles.advantages import AdvantagesConfig, AdvantagesWorker
from relax_hpc.spec.schema import AlgorithmSpec
from relax_hpc.transfer.memory import InMemoryTransferQueue
from relax_hpc.transfer.queue import TransferTimeoutError, partition_name

# Three groups of different sizes, interleaved as agent sessions may export them.
REWARDS = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
GROUPS = [7, 7, 8, 9, 8, 9, 8, 9, 9]
# Worked by hand, advantage = (r - mean) / (sample std + 1e-6):
# group 7 = (1, 0): mean 0.5, std sqrt(0.5) = 0.70711 -> +-0.70711
# group 8 = (1, 1, 1): all equal -> 0
# group 9 = (0, 1, 1, 1): mean 0.75, std sqrt(0.75 / 3) = 0.5 -> -1.5, 0.5, 0.5, 0.5
EXPECTED = [0.70711, -0.70711, 0.0, -1.5, 0.0, 0.5, 0.0, 0.5, 0.5]


def _put_step(queue: InMemoryTransferQueue, step: int) -> None:
    rows = [{"rewards": r, "group_id": g, "prompt_length": 3} for r, g in zip(REWARDS, GROUPS)]
    queue.put(partition_name(step), rows[:4])  # two puts: the role must wait for the whole step
    queue.put(partition_name(step), rows[4:])
    queue.complete(partition_name(step), len(rows))


def _advantages(queue: InMemoryTransferQueue, step: int) -> list[float]:
    batch = queue.open_session("trainer").get(partition_name(step), "actor", ["advantages"], 100, timeout=30)
    assert batch.end and batch.indices == list(range(len(REWARDS)))
    return [float(v) for v in batch.column("advantages")]  # type: ignore[arg-type]


def test_writes_group_advantages_and_the_trainer_waits_for_them() -> None:
    queue = InMemoryTransferQueue()
    _put_step(queue, 0)
    with pytest.raises(TransferTimeoutError):  # no advantages yet: a trainer would wait
        queue.open_session("trainer").get(partition_name(0), "actor", ["advantages"], 1, timeout=0.2)
    worker = AdvantagesWorker(AdvantagesConfig(AlgorithmSpec()))
    worker.start(queue, start_step=0, total_steps=1)
    assert _advantages(queue, 0) == pytest.approx(EXPECTED, abs=1e-4)
    worker.stop()
    assert worker.error() is None and worker.rows_done == len(REWARDS)


def test_dr_grpo_centres_without_dividing_by_the_std() -> None:
    queue = InMemoryTransferQueue()
    _put_step(queue, 0)
    worker = AdvantagesWorker(AdvantagesConfig(AlgorithmSpec(normalize_std=False)))
    worker.start(queue, start_step=0, total_steps=1)
    assert _advantages(queue, 0) == pytest.approx([0.5, -0.5, 0.0, -0.75, 0.0, 0.25, 0.0, 0.25, 0.25])
    worker.stop()


def test_rloo_by_group_id() -> None:
    queue = InMemoryTransferQueue()
    _put_step(queue, 0)
    worker = AdvantagesWorker(AdvantagesConfig(AlgorithmSpec(advantage="rloo")))
    worker.start(queue, start_step=0, total_steps=1)
    # group 7 (1, 0): 1 - 0 = 1, 0 - 1 = -1; group 8 all equal: 0; group 9 (0, 1, 1, 1): the
    # 0 against the others' mean 1 -> -1, each 1 against (0 + 1 + 1) / 3 -> 1/3
    assert _advantages(queue, 0) == pytest.approx([1.0, -1.0, 0.0, -1.0, 0.0, 1 / 3, 0.0, 1 / 3, 1 / 3])
    worker.stop()


def test_the_whitened_estimators_weigh_each_row_by_its_trained_tokens() -> None:
    queue = InMemoryTransferQueue()
    masks = [[1, 1], [1], [1], [1, 1, 1], [1], [1], [1], [1], [0, 0]]  # the last trains nothing
    rows = [{"rewards": r, "group_id": g, "prompt_length": 3, "loss_mask": torch.tensor(m, dtype=torch.int8)}
            for r, g, m in zip(REWARDS, GROUPS, masks)]
    queue.put(partition_name(0), rows)
    queue.complete(partition_name(0), len(rows))
    worker = AdvantagesWorker(AdvantagesConfig(AlgorithmSpec(advantage="reinforce_pp_baseline")))
    worker.start(queue, start_step=0, total_steps=1)
    want = outcome_advantages("reinforce_pp_baseline", torch.tensor(REWARDS), GROUPS,
                              torch.tensor([float(sum(m)) for m in masks]))
    got = _advantages(queue, 0)
    worker.stop()
    assert worker.error() is None
    assert got == pytest.approx(want.tolist(), abs=1e-6) and got[-1] == 0.0  # no trained token: no value
    assert len(set(round(v, 6) for v in got)) > 2  # whitened values, not a constant


def test_a_restarted_worker_gets_the_whole_unacked_step_again() -> None:
    queue = InMemoryTransferQueue()
    _put_step(queue, 0)
    _put_step(queue, 1)
    # A first worker took step 0 and died before writing or acking anything.
    dead = queue.open_session("advantages")
    assert len(dead.get(partition_name(0), "advantages", ["rewards", "group_id"], 100, timeout=5)) == len(REWARDS)
    worker = AdvantagesWorker(AdvantagesConfig(AlgorithmSpec()))
    worker.start(queue, start_step=0, total_steps=2, consumer_id="advantages")
    assert _advantages(queue, 0) == pytest.approx(EXPECTED, abs=1e-4)
    assert _advantages(queue, 1) == pytest.approx(EXPECTED, abs=1e-4)
    worker.stop()
    assert worker.rows_done == 2 * len(REWARDS)  # every row once per step: nothing counted twice


def test_stops_while_waiting_for_a_step() -> None:
    worker = AdvantagesWorker(AdvantagesConfig(AlgorithmSpec()))
    worker.start(InMemoryTransferQueue(), start_step=0, total_steps=3)
    time.sleep(0.1)
    worker.stop()
    assert worker._thread is not None and not worker._thread.is_alive() and worker.error() is None
