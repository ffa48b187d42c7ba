"""Shared helpers for the checkpoint tests: a tiny model trained a few AdamW steps.

A plain module (not conftest.py) with a unique name, so importing it by name cannot pick
up another test folder's helpers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from relax_hpc.ckpt import ResumeState


@dataclass
class Trained:
    model: nn.Module
    optimizer: torch.optim.Optimizer


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def train(steps: int, seed: int = 0) -> Trained:
    """A model and AdamW after ``steps`` updates, so optimizer moments are non-trivial."""
    torch.manual_seed(seed)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(6, 4)).pow(2).sum().backward()
        optimizer.step()
    return Trained(model, optimizer)


def fresh(seed: int = 123) -> Trained:
    torch.manual_seed(seed)
    model = make_model()
    return Trained(model, torch.optim.AdamW(model.parameters(), lr=5e-3))


def resume_state(step: int) -> ResumeState:
    return ResumeState(
        step=step,
        weight_version=step + 1,
        data_cursor={"epoch": 0, "index": 16 * step, "seed": 1},
        samples_trained=64 * step,
        extra={"rewards": [0.1 * i for i in range(step)]},
    )


def assert_same_training_state(a: Trained, b: Trained) -> None:
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for key, slots in sa["state"].items():
        for slot in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(slots[slot], sb["state"][key][slot]), (key, slot)
    assert sa["param_groups"][0]["lr"] == sb["param_groups"][0]["lr"]


def rng_draws() -> tuple[list[float], list[float], float]:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()
