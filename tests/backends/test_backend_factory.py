"""The TrainBackend boundary: the factory, and the torch backend's offload / onload for colocation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_hpc.backends.base import TrainBackend, make_backend
from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.data.sample import Sample
from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec

SETTINGS = dict(dtype="float32", device="cpu", temperature=1.0, teacher_path=None, opd_coef=1.0,
                keep_reference=True, strategy="ddp")


def _backend(model_dir: Path) -> TrainBackend:
    optim = TrainSpec(steps=1, lr=1e-3, micro_batch_size=2)
    return make_backend("torch", str(model_dir), optim, AlgorithmSpec(), **SETTINGS)


def _samples() -> list[Sample]:
    return [Sample([4, 13, 5, 16], [6, 2], [-0.5, -0.5], 0, group_id=0, prompt_index=0, advantage=1.0),
            Sample([3, 16], [3, 3, 2], [-0.5] * 3, 0, group_id=1, prompt_index=1, advantage=-1.0)]


def test_factory_builds_the_named_backend_and_names_what_is_allowed(tiny_model_dir: Path) -> None:
    assert isinstance(_backend(tiny_model_dir), TorchBackend)
    # The project venv has no megatron (it lives in tools/setup-megatron-cpu's environment).
    with pytest.raises(ValueError, match=r'train.backend = "megatron" needs megatron.core and megatron.bridge, '
                                         r'which .*python.* cannot import.*relax-hpc\[megatron\].*'
                                         r'tools/setup-megatron-cpu.*set \[train\] backend = "torch"'):
        make_backend("megatron", str(tiny_model_dir), TrainSpec(steps=1), AlgorithmSpec(), **SETTINGS)
    with pytest.raises(ValueError, match=r"train.backend = 'jax': allowed values are torch, megatron"):
        make_backend("jax", str(tiny_model_dir), TrainSpec(steps=1), AlgorithmSpec(), **SETTINGS)


def test_offload_and_onload_keep_training_identical(tiny_model_dir: Path) -> None:
    plain, offloaded = _backend(tiny_model_dir), _backend(tiny_model_dir)
    for backend in (plain, offloaded):
        backend.train(_samples())  # creates the AdamW moments
    assert offloaded.offload() == 0  # on CPU the moments already live in host memory
    offloaded.onload()
    plain.train(_samples())
    offloaded.train(_samples())
    for (name, a), (_, b) in zip(plain.named_weights(), offloaded.named_weights()):
        assert torch.equal(a, b), name
