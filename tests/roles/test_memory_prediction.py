"""`validate`'s per-GPU prediction (relax_hpc/spec/memory_estimate.py) against the bytes a trainer
really holds after a step (relax_hpc/roles/memory.py), at two tiny sizes, in bfloat16 so the
float32 master weights and AdamW state the prediction assumes must really be there. The sharded
case (fsdp2 over 2 ranks) is held against a real run's records in tests/driver/test_sglang_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.data.sample import Sample
from relax_hpc.models.tiny import TinyModelSize, vocab_size, write_tiny_model
from relax_hpc.roles.memory import trainer_record
from relax_hpc.spec import parse_spec
from relax_hpc.spec.memory_estimate import memory_estimate
from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec

SIZES = {"default": TinyModelSize(), "wider": TinyModelSize(hidden_size=128, intermediate_size=384, head_dim=32)}
TOLERANCE = 0.10


def _spec(model_dir: Path) -> object:
    return parse_spec(
        f'[job]\nname = "m"\n[model]\npath = "{model_dir}"\ndtype = "bfloat16"\n'
        '[data]\npath = "x.jsonl"\n[reward]\nfunction = "tiny_sum"\n[train]\nsteps = 1\n'
    )


def _samples() -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    return [Sample(torch.randint(3, vocab_size(), (3,), generator=gen).tolist(),
                   torch.randint(3, vocab_size(), (4,), generator=gen).tolist(), [0.0] * 4, 0,
                   group_id=i // 2, prompt_index=i // 2, advantage=float(i % 2) - 0.5) for i in range(4)]


@pytest.mark.parametrize("size", list(SIZES))
def test_the_predicted_trainer_bytes_are_the_measured_ones_within_ten_percent(size: str, tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / size, size=SIZES[size])
    backend = TorchBackend(model_dir, TrainSpec(steps=1, lr=1e-6, micro_batch_size=2), AlgorithmSpec(name="grpo"),
                           dtype="bfloat16")
    backend.train(_samples())
    measured = trainer_record(backend, 0, {}).on_device
    (trainer, *_) = memory_estimate(_spec(model_dir), json.loads((model_dir / "config.json").read_text()))
    assert trainer.name == "trainer"
    for kind in ("parameters", "gradients", "optimizer"):
        predicted, held = getattr(trainer, kind), measured[kind]
        assert abs(held - predicted) <= TOLERANCE * predicted, (size, kind, held, predicted)
    # float32 masters of a bfloat16 model: 4 bytes a parameter, not 2
    assert measured["parameters"] == 4 * sum(p.numel() for p in backend.model.parameters())
