"""ActorWorker.train_from_queue on an in-memory queue: rows packed straight from their tensors train
like `train` on the same samples, every row is acked, and the archive still gets the samples."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from relax_hpc.data.rows import sample_to_row
from relax_hpc.data.sample import Sample
from relax_hpc.ops.archive import archive_dir, read_archive
from relax_hpc.roles.actor import ActorConfig, ActorWorker
from relax_hpc.spec.schema import AlgorithmSpec, CheckpointSpec, JobInfoSpec, ModelSpec, RolloutSpec, TrainSpec
from relax_hpc.transfer.memory import InMemoryTransferQueue
from relax_hpc.transfer.queue import partition_name

STEP = 3
MICRO = 3  # 8 rows arrive as micro-batches of 3, 3 and 2


def _config(model: Path, tmp_path: Path, **optim: int) -> ActorConfig:
    return ActorConfig(
        model=ModelSpec(path=str(model)), train=TrainSpec(steps=1, lr=1e-3, grad_clip=0.0, micro_batch_size=MICRO, **optim),
        algorithm=AlgorithmSpec(), rollout=RolloutSpec(), checkpoint=CheckpointSpec(keep_last=1),
        job=JobInfoSpec(name="queue", seed=0), checkpoint_dir=str(tmp_path / "checkpoints"),
    )


def _samples(worker: ActorWorker) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        prompt = torch.randint(3, 17, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        response = torch.randint(3, 17, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist()
        mask = [1] * len(response)
        if len(response) > 1:
            mask[0] = 0  # an observation token inside the response
        samples.append(Sample(prompt, response, [0.0] * len(response), weight_version=STEP, group_id=i // 4,
                              prompt_index=10 + i, reward=float(i % 2), raw_reward=float(i % 2),
                              advantage=float(i % 2) - 0.5, loss_mask=mask))
    for s, lp in zip(samples, worker.compute_log_probs(samples)):
        s.rollout_log_probs = lp
    return samples


def _queue_with(samples: list[Sample]) -> InMemoryTransferQueue:
    queue = InMemoryTransferQueue()
    queue.put(partition_name(STEP), [sample_to_row(s) for s in samples])
    queue.complete(partition_name(STEP), len(samples))
    return queue


def _step_counts(worker: ActorWorker) -> set[int]:
    return {int(state["step"]) for state in worker.backend.optimizer.state.values()}


def test_streamed_rows_train_like_the_samples_and_are_acked(tiny_model_dir: Path, tmp_path: Path) -> None:
    reference = ActorWorker(_config(tiny_model_dir, tmp_path))
    samples = _samples(reference)
    reference.train(samples)
    worker = ActorWorker(_config(tiny_model_dir, tmp_path))
    queue = _queue_with(samples)
    stats = worker.train_from_queue(queue, STEP, timeout_s=30)
    assert stats["rows"] == 8
    assert stats["reward_sum"] == sum(s.reward for s in samples) == 4.0
    for (name, want), got in zip(reference.backend.model.named_parameters(), worker.backend.model.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert _step_counts(worker) == {1}
    # Every row was acked: a restarted trainer session gets nothing more of this step.
    after = queue.open_session("actor-rank0").get(partition_name(STEP), "actor", ["tokens"], MICRO, timeout=5)
    assert after.end and after.rows == []


def test_several_mini_batches_take_one_optimizer_step_each(tiny_model_dir: Path, tmp_path: Path) -> None:
    worker = ActorWorker(_config(tiny_model_dir, tmp_path, mini_batches=2))
    stats = worker.train_from_queue(_queue_with(_samples(worker)), STEP, timeout_s=30)
    assert stats["rows"] == 8 and _step_counts(worker) == {2}


def test_the_archive_gets_the_trained_samples(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = dataclasses.replace(_config(tiny_model_dir, tmp_path), archive_dir=str(archive_dir(tmp_path)))
    worker = ActorWorker(cfg)
    samples = _samples(worker)
    worker.train_from_queue(_queue_with(samples), STEP, timeout_s=30)
    archived = read_archive(tmp_path)[STEP]
    assert [(r.prompt_ids, r.response_ids, r.loss_mask, r.prompt_index) for r in archived] == [
        (s.prompt_ids, s.response_ids, s.mask(), s.prompt_index) for s in samples]
    assert [r.reward for r in archived] == [s.reward for s in samples]
    # float32 values (the trainer's log-probs) survive the float32 archive exactly.
    assert [r.rollout_log_probs for r in archived] == [s.rollout_log_probs for s in samples]


def test_time_spent_waiting_for_rows_is_reported(tiny_model_dir: Path, tmp_path: Path) -> None:
    import threading
    import time

    worker = ActorWorker(_config(tiny_model_dir, tmp_path))
    samples = _samples(worker)
    queue = InMemoryTransferQueue()

    def produce_late() -> None:
        time.sleep(0.5)  # the trainer is already waiting in get
        queue.put(partition_name(STEP), [sample_to_row(s) for s in samples])
        queue.complete(partition_name(STEP), len(samples))

    producer = threading.Thread(target=produce_late)
    producer.start()
    stats = worker.train_from_queue(queue, STEP, timeout_s=30)
    producer.join()
    assert stats["rows"] == 8.0 and stats["queue_wait_s"] >= 0.4
    fresh = ActorWorker(_config(tiny_model_dir, tmp_path))  # a worker keeps its first queue
    ready = fresh.train_from_queue(_queue_with(samples), STEP, timeout_s=30)
    assert ready["queue_wait_s"] < stats["queue_wait_s"]  # rows already there: no such wait
