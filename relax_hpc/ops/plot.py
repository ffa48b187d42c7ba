"""The reward-curve PNG written at the end of a run (and by `relax-hpc plot`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from relax_hpc.ops.metrics import read_metrics


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_reward_curve(metrics_path: Path, out_path: Path, title: str = "") -> Path:
    """Plot reward/mean per step (and its moving average) from a metrics JSONL into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if "reward/mean" in r]
    if not rows:
        raise ValueError(f"{metrics_path} has no reward/mean records to plot")
    steps = [int(r["step"]) for r in rows]
    rewards = [float(r["reward/mean"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, rewards, color="#9bbbe0", linewidth=1, label="reward per step")
    window = max(1, len(rewards) // 20)
    ax.plot(steps, moving_average(rewards, window), color="#1f5fa8", linewidth=2,
            label=f"moving average ({window} steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title or "reward")
    ax.set_ylim(bottom=min(0.0, min(rewards)))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=out_path.parent)
    os.close(fd)
    fig.savefig(tmp)
    plt.close(fig)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; the curve is for anyone who can read the job dir
    os.replace(tmp, out_path)
    return out_path
