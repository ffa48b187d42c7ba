"""A tiny in-process run with the plots redrawn during it and MLflow on (its file store): the
writer drew on its own thread while the run went on, and MLflow holds the run's reward curve."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import tiny_spec_text
from offline_trackers import needs_mlflow, offline_sandbox

import relax_hpc.driver.run as run_module
from relax_hpc.driver.run import run_job
from relax_hpc.ops.metrics import read_metrics
from relax_hpc.ops.trackers import read_mlflow_history
from relax_hpc.spec import parse_spec

pytestmark = [pytest.mark.slow, needs_mlflow]

METRICS = """
[metrics]
mlflow_experiment = "relax-test"
plot_every_steps = 2
"""


def test_a_tiny_run_redraws_its_plots_and_reads_back_from_mlflow(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = tmp_path / "job"
    spec = parse_spec(tiny_spec_text(tiny_model_dir, job, steps=4, save_interval=4, name="plots", extra=METRICS))
    draws: list[tuple[str, int]] = []  # (thread, last step in metrics.jsonl) of each draw
    draw = run_module.draw_plots

    def counted(*args: Any) -> Any:
        draws.append((threading.current_thread().name, len(read_metrics(job / "metrics.jsonl"))))
        return draw(*args)

    monkeypatch.setattr(run_module, "draw_plots", counted)
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "matplotlib"))  # its font cache, out of HOME
    with offline_sandbox(monkeypatch, tmp_path / "home"):
        run_job(spec, in_process=True, progress=False)

    # Due at steps 2 and 4 on the writer's thread (4 skipped if 2's draw still ran; a draw reads
    # what metrics.jsonl holds when it starts, which may be a step more), then the final draw on
    # the driver's.
    during = [steps for thread, steps in draws if thread == "plot-writer"]
    assert 1 <= len(during) <= 2 and all(2 <= steps <= 4 for steps in during), draws
    assert draws[-1] == ("MainThread", 4)
    for name in ("reward_curve.png", "plots.png"):
        assert (job / name).read_bytes().startswith(b"\x89PNG") and (job / name).stat().st_mode & 0o777 == 0o600

    curve = {int(row["step"]): row["reward/mean"] for row in read_metrics(job / "metrics.jsonl")}
    history = read_mlflow_history(job)
    assert sorted(curve) == [1, 2, 3, 4]
    assert {step: m["reward/mean"] for step, m in history.items()} == curve
    assert history[4].keys() == {k for k in read_metrics(job / "metrics.jsonl")[-1] if k != "step"}
    assert (job / "mlflow").stat().st_mode & 0o777 == 0o700
    summary = json.loads((job / "summary.json").read_text())
    assert summary["metrics/sink_failures"] == {"jsonl": 0, "tensorboard": 0, "mlflow": 0}
