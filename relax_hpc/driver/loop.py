"""The training loop: generate -> score -> advantages -> train -> sync weights -> checkpoint.

Read it top to bottom; everything it does is a call on a role handle. It resumes from the newest
complete checkpoint, and stops cleanly (checkpoint first) when `stop.requested` is set by a
signal handler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from relax_hpc.algos import group_advantages
from relax_hpc.ckpt import ResumeState
from relax_hpc.data.sample import Sample
from relax_hpc.ops.metrics import MetricsSink
from relax_hpc.roles.handles import Roles


@dataclass(frozen=True)
class LoopConfig:
    total_steps: int
    n_samples_per_prompt: int
    normalize_std: bool
    save_interval: int
    resume: bool


@dataclass
class StopFlag:
    requested: bool = False
    reason: str = ""


@dataclass
class LoopResult:
    start_step: int
    end_step: int
    samples_trained: int
    stopped_early: bool
    last_checkpoint: str | None
    rewards: list[float] = field(default_factory=list)


def assign_advantages(samples: list[Sample], group_size: int, normalize_std: bool) -> None:
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    for s, a in zip(samples, group_advantages(rewards, group_size, normalize_std).tolist()):
        s.advantage = a


def step_metrics(samples: list[Sample], rollout: dict[str, float], train: dict[str, float],
                 step_time: float, version: int) -> dict[str, float]:
    rewards = [s.reward for s in samples]
    out = {
        "reward/mean": sum(rewards) / len(rewards),
        "reward/max": max(rewards),
        "reward/min": min(rewards),
        "time/step_s": step_time,
        "weight_version": float(version),
        **rollout,
        **{f"train/{k}": v for k, v in train.items()},
    }
    return out


def run_loop(
    cfg: LoopConfig,
    roles: Roles,
    metrics: MetricsSink,
    stop: StopFlag,
    on_step: Callable[[int, dict[str, float]], None] = lambda step, m: None,
) -> LoopResult:
    state = roles.load_checkpoint() if cfg.resume else None
    step, version, samples_trained = 0, 0, 0
    if state is not None:
        step, version, samples_trained = state.step, state.weight_version, state.samples_trained
        roles.restore_cursor(state.data_cursor)
        roles.weights.sync(version)
    result = LoopResult(step, step, samples_trained, False, None)

    while step < cfg.total_steps and not stop.requested:
        t0 = time.perf_counter()
        samples, rollout_stats = roles.generate(step)
        assign_advantages(samples, cfg.n_samples_per_prompt, cfg.normalize_std)
        train_stats = roles.train(samples)
        version += 1
        roles.weights.sync(version)
        step += 1
        samples_trained += len(samples)
        m = step_metrics(samples, rollout_stats, train_stats, time.perf_counter() - t0, version)
        metrics.log(step, m)
        on_step(step, m)
        result.rewards.append(m["reward/mean"])
        if step % cfg.save_interval == 0 or step == cfg.total_steps or stop.requested:
            resume = ResumeState(step, version, roles.cursor_state(), samples_trained)
            result.last_checkpoint = roles.save_checkpoint(resume)

    result.end_step, result.samples_trained = step, samples_trained
    result.stopped_early = step < cfg.total_steps
    return result
