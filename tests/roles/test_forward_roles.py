"""ActorFwd / Reference roles on the real ZMQ queue: fields written, and a killed worker's
restart loses and repeats nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from relax_hpc.auth import job_secret
from relax_hpc.data.rows import sample_to_row
from relax_hpc.data.sample import Sample
from relax_hpc.models.hf import load_causal_lm
from relax_hpc.roles.forward import ForwardConfig, ForwardKind, ForwardWorker, response_log_probs
from relax_hpc.spec.schema import ModelSpec, RolloutSpec, TrainSpec
from relax_hpc.transfer import TransferQueueClient, TransferQueueServer, partition_name

ROWS, MICRO = 64, 8


def _config(kind: ForwardKind, model_dir: Path) -> ForwardConfig:
    """The role as a spec with this model and micro_batch_size MICRO configures it ([train] steps unused)."""
    return ForwardConfig(kind=kind, model=ModelSpec(path=str(model_dir)), train=TrainSpec(steps=1, micro_batch_size=MICRO),
                         rollout=RolloutSpec())
SECRET = job_secret()  # the roles connect with the job's secret (tests/conftest.py sets it)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from relax_hpc.models.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("fwd") / "tiny", seed=2)


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(ROWS):
        prompt = torch.randint(3, 48, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        response = torch.randint(3, 48, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(prompt, response, [0.0] * len(response), 0, i // 8, i))
    return out


@pytest.fixture()
def queue_with_rows() -> tuple[str, list[Sample]]:
    server = TransferQueueServer("tcp://127.0.0.1:0", secret=SECRET)
    address = server.start()
    samples = _samples()
    producer = TransferQueueClient(address, secret=SECRET, consumer_id="rollout")
    producer.put(partition_name(0), [sample_to_row(s) for s in samples])
    producer.complete(partition_name(0), ROWS)
    producer.close()
    yield address, samples
    server.stop()


def _trainer_view(address: str, field: str) -> dict[int, torch.Tensor]:
    """What the trainer would get: every row with the role's field, once."""
    consumer = TransferQueueClient(address, secret=SECRET, consumer_id="actor-rank0")
    got: dict[int, torch.Tensor] = {}
    while True:
        batch = consumer.get(partition_name(0), "actor", ["tokens", field], 16, timeout=30)
        for i, row in zip(batch.indices, batch.rows):
            assert i not in got, f"row {i} delivered twice"
            got[i] = row[field]
        if batch.end:
            break
    consumer.close()
    return got


def test_reference_role_writes_reference_log_probs(model_dir: Path, queue_with_rows: tuple[str, list[Sample]]) -> None:
    address, samples = queue_with_rows
    worker = ForwardWorker(_config("reference", model_dir))
    worker.start(address, 0, 1)
    got = _trainer_view(address, "ref_log_probs")
    worker.stop()
    assert worker.error() is None and worker.rows_done == ROWS
    expected = response_log_probs(load_causal_lm(model_dir).eval(), samples, 0, 1.0, "cpu")
    assert sorted(got) == list(range(ROWS))
    for i, values in got.items():
        torch.testing.assert_close(values, expected[i], atol=1e-5, rtol=0)


def test_killed_actor_fwd_restarts_where_it_stopped(model_dir: Path, queue_with_rows: tuple[str, list[Sample]]) -> None:
    address, samples = queue_with_rows
    # The first worker dies (no cleanup, like SIGKILL) with its third batch in hand, before
    # writing it, having written two. The ack of the second rides on the get of the fourth batch,
    # which was sent before the third was handed over; the pause lets it leave the process.
    script = textwrap.dedent(f"""
        import os, time
        from relax_hpc.roles import forward, step_loop
        real_connect = step_loop.connect_queue
        def connect(target, consumer_id):
            queue = real_connect(target, consumer_id)
            real_write, calls = queue.write, [0]
            def write(*args, **kwargs):
                calls[0] += 1
                if calls[0] == 3:
                    time.sleep(0.3)
                    os._exit(137)
                return real_write(*args, **kwargs)
            queue.write = write
            return queue
        step_loop.connect_queue = connect
        from relax_hpc.spec.schema import ModelSpec, RolloutSpec, TrainSpec
        cfg = forward.ForwardConfig(kind="actor_fwd", model=ModelSpec(path={str(model_dir)!r}),
                                    train=TrainSpec(steps=1, micro_batch_size={MICRO}), rollout=RolloutSpec())
        forward.ForwardWorker(cfg)._run({address!r}, 0, 1, "actor_fwd", 0)
    """)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    killed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == 137, killed.stderr

    restarted = ForwardWorker(_config("actor_fwd", model_dir))
    restarted.start(address, 0, 1)
    got = _trainer_view(address, "log_probs")
    restarted.stop()
    assert restarted.error() is None
    # Two batches were done before the kill; the third was received but never acked (nor the
    # fourth, fetched ahead), so the restart does them with the rest: nothing lost, nothing done twice.
    assert restarted.rows_done == ROWS - 2 * MICRO
    assert sorted(got) == list(range(ROWS))
    expected = response_log_probs(load_causal_lm(model_dir).eval(), samples, 0, 1.0, "cpu")
    for i, values in got.items():
        torch.testing.assert_close(values, expected[i], atol=1e-5, rtol=0)


def test_actor_fwd_waits_for_the_weights_of_its_step(model_dir: Path, queue_with_rows: tuple[str, list[Sample]]) -> None:
    address, _ = queue_with_rows
    worker = ForwardWorker(_config("actor_fwd", model_dir))
    worker.start(address, 1, 2)  # step 1 needs weight version 1
    probe = TransferQueueClient(address, secret=SECRET, consumer_id="probe")
    producer = TransferQueueClient(address, secret=SECRET, consumer_id="rollout2")
    rows = [sample_to_row(s) for s in _samples()[:MICRO]]
    producer.put(partition_name(1), rows)
    producer.complete(partition_name(1), MICRO)
    with pytest.raises(TimeoutError):  # no log_probs while the worker still runs version 0
        probe.get(partition_name(1), "watch", ["log_probs"], MICRO, timeout=1.0)
    new = [(n, t + 0.5) for n, t in worker.model.state_dict().items()]
    worker.update_weights(new, 1)
    batch = probe.get(partition_name(1), "watch", ["log_probs"], MICRO, timeout=30)
    assert len(batch) == MICRO and worker.weight_version() == 1
    worker.stop()
    probe.close()
    producer.close()
