"""The trainer's side of colocation, on the in-memory backend twin: the optimizer state leaves
the device after each step and comes back only when the next step's rows arrive (the engines
generate in between), and before a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_hpc.backends.memory import RecordingBackend
from relax_hpc.ckpt import ResumeState
from relax_hpc.data.rows import sample_to_row
from relax_hpc.data.sample import Sample
from relax_hpc.roles.actor import ActorConfig, ActorWorker
from relax_hpc.spec.schema import AlgorithmSpec, CheckpointSpec, JobInfoSpec, ModelSpec, RolloutSpec, TrainSpec
from relax_hpc.transfer.memory import InMemoryTransferQueue
from relax_hpc.transfer.queue import partition_name


def _worker(tmp_path: Path, backend: RecordingBackend, offload: bool = True) -> ActorWorker:
    cfg = ActorConfig(model=ModelSpec(path="unused: the backend is given"), train=TrainSpec(steps=1, micro_batch_size=2),
                      algorithm=AlgorithmSpec(), rollout=RolloutSpec(), checkpoint=CheckpointSpec(keep_last=1),
                      job=JobInfoSpec(name="offload", seed=0), checkpoint_dir=str(tmp_path / "checkpoints"),
                      offload_between_steps=offload)
    return ActorWorker(cfg, backend=backend)


def _put_step(queue: InMemoryTransferQueue, step: int, rows: int) -> None:
    samples = [Sample([1, 2], [3, 4], [-0.5, -0.5], weight_version=step, group_id=i // 2, prompt_index=i,
                      reward=1.0, raw_reward=1.0, advantage=0.5, loss_mask=[1, 1]) for i in range(rows)]
    queue.put(partition_name(step), [sample_to_row(s) for s in samples])
    queue.complete(partition_name(step), rows)


def test_the_optimizer_is_off_the_device_from_a_step_to_the_next_steps_rows(tmp_path: Path) -> None:
    backend = RecordingBackend(optimizer_bytes=4096)
    worker, queue = _worker(tmp_path, backend), InMemoryTransferQueue()
    _put_step(queue, 0, rows=4)
    first = worker.train_from_queue(queue, 0, timeout_s=30)
    assert backend.calls == ["train_stream", "offload"] and first["offloaded_bytes"] == 4096
    assert backend.rows_trained == 4

    _put_step(queue, 1, rows=6)  # the engines generated step 1 while the optimizer was away
    second = worker.train_from_queue(queue, 1, timeout_s=30)
    assert backend.calls[2:] == ["onload", "train_stream", "offload"] and second["offloaded_bytes"] == 4096
    assert backend.rows_trained == 10

    worker.save_checkpoint(ResumeState(2, 2, {}, 10))  # the checkpoint holds the state where it trains
    assert backend.calls[5:] == ["onload", "save_checkpoint"]
    assert (tmp_path / "checkpoints" / "step_2").is_dir()


def test_without_colocation_nothing_moves(tmp_path: Path) -> None:
    backend = RecordingBackend(optimizer_bytes=4096)
    worker, queue = _worker(tmp_path, backend, offload=False), InMemoryTransferQueue()
    _put_step(queue, 0, rows=2)
    stats = worker.train_from_queue(queue, 0, timeout_s=30)
    assert backend.calls == ["train_stream"] and "offloaded_bytes" not in stats


def test_the_twin_refuses_to_train_while_offloaded() -> None:
    backend = RecordingBackend()
    backend.offload()
    with pytest.raises(RuntimeError, match=r"offloaded: onload\(\) first"):
        backend.train([])


def test_the_twin_offers_everything_a_backend_does() -> None:
    from relax_hpc.backends.base import TrainBackend
    from relax_hpc.backends.torch_backend import TorchBackend

    wanted = [name for name in vars(TrainBackend) if not name.startswith("_")]  # the methods
    assert {"train_stream", "offload", "onload", "named_weights"} <= set(wanted)
    for cls in (RecordingBackend, TorchBackend):
        missing = [name for name in wanted if not hasattr(cls, name)]
        assert missing == [], (cls.__name__, missing)
