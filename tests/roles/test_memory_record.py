"""The bytes a role holds, counted from its tensors: hand-worked figures on small modules."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from relax_hpc.ops.run_status import memory_lines
from relax_hpc.roles.memory import StorageCounter, rollout_record, trainer_record
from relax_hpc.weights.flat import FlatWeights, bind_module


class _Tied(torch.nn.Module):
    """An embedding of 10 x 4 float32 (160 B) tied to the output head, and a 4 x 4 linear with
    bias (64 + 16 B): 240 B of parameters, 60 values."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def _trained() -> SimpleNamespace:
    torch.manual_seed(0)
    model = _Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.head(model.proj(model.embed(torch.tensor([1, 2])))).sum().backward()
    optimizer.step()
    return SimpleNamespace(model=model, optimizer=optimizer, device=torch.device("cpu"), reference=None)


def test_a_trainer_counts_parameters_gradients_and_adam_state_once_per_storage() -> None:
    backend = _trained()
    record = trainer_record(backend, 0, {"weight_snapshot": []})
    assert record.model_bytes == 240  # the tied weight is one parameter
    assert record.on_device["parameters"] == 240
    assert record.on_device["gradients"] == 240
    # AdamW: exp_avg and exp_avg_sq per parameter (2 x 240 B) and a float32 step each (3 x 4 B)
    assert record.on_device["optimizer"] == 2 * 240 + 3 * 4
    assert record.on_device["reference"] == 0 and record.device_total() == 240 + 240 + 492


def test_a_reference_copy_and_a_host_snapshot_are_their_own_categories() -> None:
    backend = _trained()
    backend.reference = _Tied()  # 240 B of parameters, no buffers
    snapshot = FlatWeights.snapshot(list(backend.model.state_dict().items()), 4096, 4096)
    record = trainer_record(backend, 1, {"weight_snapshot": [snapshot.buffer]}, channel_bytes=128)
    assert record.rank == 1 and record.on_device["reference"] == 240
    assert record.in_host_memory["weight_snapshot"] == snapshot.nbytes and record.on_device["channel_buffers"] == 128


def test_an_engine_bound_to_the_inbox_buffer_counts_it_once_as_engine_weights() -> None:
    engine = _Tied()
    flat = FlatWeights.snapshot(list(engine.state_dict().items()), 4096, 4096)
    spare = FlatWeights(flat.buckets)
    assert bind_module(engine, flat)
    record = rollout_record([engine], [flat.buffer, spare.buffer], "cpu", buffers_on_device=True)
    assert record.on_device["engine_weights"] == flat.nbytes  # the parameters are views into it
    assert record.on_device["channel_buffers"] == spare.nbytes  # only the spare adds
    host = rollout_record([], [flat.buffer, spare.buffer], "cpu", buffers_on_device=False, channel_bytes=64)
    assert host.on_device == {"engine_weights": 0, "channel_buffers": 64}
    assert host.in_host_memory["weight_buffers"] == 2 * flat.nbytes


def test_meta_tensors_and_views_of_a_counted_storage_add_nothing() -> None:
    count = StorageCounter()
    base = torch.zeros(8)
    assert count.bytes_of([base, base[2:], torch.empty(100, device="meta"), None]) == 32


def test_status_prints_each_role_with_its_share_of_the_model() -> None:
    record = trainer_record(_trained(), 0, {"gathered_weights": []}).as_dict()
    (line,) = memory_lines([record])
    assert line.startswith("  memory     trainer 0 on cpu: parameters 0.0 MiB")
    assert "(100% of the model's parameters)" in line and "host" not in line


def test_an_engine_actor_counts_its_model_once() -> None:
    from relax_hpc.roles.memory import engine_record

    record = engine_record(_Tied(), 1, "cpu")
    assert (record.role, record.rank, record.model_bytes, record.on_device) == ("engine", 1, 240, {"engine_weights": 240})
    assert engine_record(None, 0, "cpu").on_device == {"engine_weights": 0}
