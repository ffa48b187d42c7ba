"""The job's plots: `reward_curve.png` (the reward alone) and `plots.png` (one panel per metric
worth watching), drawn from metrics.jsonl.

The driver redraws both every `[metrics] plot_every_steps` steps on a thread of its own
(`PlotWriter`) and once more at the end; `relax-hpc plot JOBDIR` draws the same at any time.
Each file is drawn to a temporary name in its folder and renamed over the old one, so a reader
sees the previous plot or the new one, never a half-written file. matplotlib (Agg, no display)
is imported only when a plot is drawn, and only its object API is used (no pyplot state), so a
draw on the writer's thread shares nothing with the rest of the process.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.ops.metrics import read_metrics

log = logging.getLogger(__name__)

REWARD_CURVE = "reward_curve.png"
PANELS_PNG = "plots.png"
PUBLIC_MODE = 0o644  # `relax-hpc plot`: for anyone who can read the job dir (a run writes 0600)
NOT_RECORDED = "not recorded"


def _key(name: str) -> Callable[[Mapping[str, float]], float | None]:
    return lambda row: row.get(name)


def _trained_samples_per_s(row: Mapping[str, float]) -> float | None:
    samples, seconds = row.get("samples/step"), row.get("time/step_s")
    if samples is None or not seconds:
        return None
    return samples / seconds


@dataclass(frozen=True)
class Panel:
    name: str
    title: str
    ylabel: str
    value: Callable[[Mapping[str, float]], float | None]  # a step's value; None: not in that record


# The panels of plots.png, in reading order; the metric names are those the loop logs
# (driver/loop.py: step_metrics; train/* from algos/losses.py, rollout/* from roles/rollout.py).
PANELS: tuple[Panel, ...] = (
    Panel("reward", "reward (reward/mean)", "mean reward", _key("reward/mean")),
    Panel("policy_loss", "policy loss (train/loss/policy)", "loss", _key("train/loss/policy")),
    Panel("kl", "KL to the reference (train/loss/kl)", "KL", _key("train/loss/kl")),
    Panel("entropy", "entropy (train/entropy)", "nats", _key("train/entropy")),
    Panel("response_length", "response length (rollout/response_len)", "tokens", _key("rollout/response_len")),
    Panel("step_time", "step time (time/step_s)", "seconds", _key("time/step_s")),
    Panel("samples_per_s", "samples trained per second", "samples / s", _trained_samples_per_s),
)


@dataclass(frozen=True)
class RunPlots:
    reward_curve: Path
    panels_png: Path
    recorded: dict[str, bool]  # panel name -> whether metrics.jsonl holds its metric


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def replace_atomically(out_path: Path, write: Callable[[Path], None], mode: int = PUBLIC_MODE) -> Path:
    """`write(tmp)` into a hidden temporary file next to `out_path`, then rename it over
    `out_path`: readers see the old file or the new one, never part of one. A failed write
    leaves `out_path` as it was."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, mode)  # mkstemp creates 0600
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out_path


def plot_run(metrics_path: Path, out_dir: Path, title: str = "", mode: int = PUBLIC_MODE) -> RunPlots:
    """Draw `out_dir/reward_curve.png` and `out_dir/plots.png` from a metrics JSONL.

    Raises ValueError when it holds no reward/mean record yet. A panel whose metric no record
    holds (KL without a reference model) says "not recorded"; `RunPlots.recorded` tells which.
    """
    rows = read_metrics(metrics_path, partial_last_line_ok=True)
    if not any("reward/mean" in r for r in rows):
        raise ValueError(f"{metrics_path} has no reward/mean records to plot yet; "
                         "it gets one per trained step (is [metrics] jsonl = false?)")
    curve = replace_atomically(out_dir / REWARD_CURVE, lambda tmp: _save(_reward_figure(rows, title), tmp), mode)
    figure, recorded = _panels_figure(rows, title)
    panels = replace_atomically(out_dir / PANELS_PNG, lambda tmp: _save(figure, tmp), mode)
    return RunPlots(curve, panels, recorded)


def plot_reward_curve(metrics_path: Path, out_path: Path, title: str = "", mode: int = PUBLIC_MODE) -> Path:
    """The reward curve alone (reward/mean per step and its moving average) into `out_path`."""
    rows = read_metrics(metrics_path, partial_last_line_ok=True)
    if not any("reward/mean" in r for r in rows):
        raise ValueError(f"{metrics_path} has no reward/mean records to plot")
    return replace_atomically(out_path, lambda tmp: _save(_reward_figure(rows, title), tmp), mode)


def _figure(width: float, height: float) -> Any:
    """A figure with fixed margins (the callers set them): matplotlib's constrained layout measured
    every label again at each draw and took about half of a draw's time."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110)


def _save(figure: Any, path: Path) -> None:
    figure.savefig(path, format="png")


def _series(rows: list[dict[str, float]], value: Callable[[Mapping[str, float]], float | None]
            ) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in rows:
        v = value(row)
        if v is not None:
            steps.append(int(row["step"]))
            values.append(float(v))
    return steps, values


def _draw_series(ax: Any, steps: list[int], values: list[float], light: str, dark: str,
                 label: str = "per step") -> None:
    from matplotlib.ticker import MaxNLocator

    marker = "o" if len(values) <= 30 else None  # a few points: show each one
    window = max(1, len(values) // 20)
    # Light under its moving average; dark on its own when there are too few steps to average.
    ax.plot(steps, values, color=light if window > 1 else dark, linewidth=1, marker=marker, markersize=3,
            label=label)
    if window > 1:
        ax.plot(steps, moving_average(values, window), color=dark, linewidth=2,
                label=f"moving average ({window} steps)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers


def _reward_figure(rows: list[dict[str, float]], title: str) -> Any:
    steps, rewards = _series(rows, _key("reward/mean"))
    fig = _figure(7, 4)
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.13, top=0.91)
    ax = fig.add_subplot()
    _draw_series(ax, steps, rewards, "#9bbbe0", "#1f5fa8", "reward per step")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title or "reward")
    ax.set_ylim(bottom=min(0.0, min(rewards)))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return fig


def _panels_figure(rows: list[dict[str, float]], title: str) -> tuple[Any, dict[str, bool]]:
    """The reward across the top, the other panels two by two below it."""
    fig = _figure(11, 12)
    grid = fig.add_gridspec(1 + (len(PANELS) - 1 + 1) // 2, 2, left=0.08, right=0.98, bottom=0.04, top=0.93,
                            hspace=0.45, wspace=0.22)
    recorded: dict[str, bool] = {}
    for i, panel in enumerate(PANELS):
        ax = fig.add_subplot(grid[0, :] if i == 0 else grid[1 + (i - 1) // 2, (i - 1) % 2])
        steps, values = _series(rows, panel.value)
        recorded[panel.name] = bool(values)
        ax.set_title(panel.title, fontsize=11)
        ax.set_xlabel("step")
        if not values:
            ax.text(0.5, 0.5, NOT_RECORDED, transform=ax.transAxes, ha="center", va="center",
                    color="#888888", fontsize=12)
            ax.set_yticks([])
            ax.set_xticks([])
            continue
        _draw_series(ax, steps, values, "#9bbbe0", "#1f5fa8")
        ax.set_ylabel(panel.ylabel)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
        ax.grid(alpha=0.3)
    if rows:
        first, last = int(rows[0]["step"]), int(rows[-1]["step"])
        fig.suptitle(f"{title or 'run'}: steps {first} to {last}", fontsize=13)
    return fig, recorded


class PlotWriter:
    """Calls `draw()` on a thread of its own every `every_steps` steps (0: never).

    `on_step(step)` returns at once: when the previous draw is still running the due one is
    skipped, not queued (the next due step draws the newer data anyway). A draw that raises is
    logged once and counted; training never sees it. `close()` waits for a draw in progress.
    """

    def __init__(self, every_steps: int, draw: Callable[[], object], name: str = "plot-writer") -> None:
        self.every_steps = every_steps
        self._draw = draw
        self._name = name
        self._thread: threading.Thread | None = None
        self.started: list[int] = []  # the steps a draw started at
        self.skipped: list[int] = []  # due steps skipped because a draw was still running
        self.failures = 0

    def on_step(self, step: int) -> bool:
        """Start a draw when `step` is due and none is running; True when one started."""
        if self.every_steps <= 0 or step % self.every_steps:
            return False
        if self.busy:
            self.skipped.append(step)
            return False
        self._thread = threading.Thread(target=self._run, args=(step,), name=self._name, daemon=True)
        self.started.append(step)
        self._thread.start()
        return True

    @property
    def busy(self) -> bool:
        """A draw is running."""
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout_s: float = 300.0) -> None:
        """Wait for a draw in progress (at most `timeout_s`; the thread is a daemon)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self, step: int) -> None:
        try:
            self._draw()
        except Exception as error:  # noqa: BLE001 - a plot never stops training
            self.failures += 1
            if self.failures == 1:
                log.warning("drawing the plots at step %d failed (%r); training goes on, the next "
                            "due step tries again", step, error)
