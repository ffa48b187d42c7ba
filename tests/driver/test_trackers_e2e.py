"""A tiny in-process run with W&B and ClearML on (offline): both hold the run's reward curve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e_helpers import tiny_spec_text
from offline_trackers import needs_clearml, needs_wandb, offline_sandbox

from relax_hpc.driver.run import run_job
from relax_hpc.ops.metrics import read_metrics
from relax_hpc.ops.trackers import read_clearml_scalars, read_wandb_history
from relax_hpc.spec import parse_spec

# clearml's bundled config parser calls pyparsing by its old, deprecated names.
pytestmark = [pytest.mark.slow, needs_wandb, needs_clearml,
              pytest.mark.filterwarnings("ignore:.*deprecated.*use:DeprecationWarning")]

TRACKERS = """
[metrics]
wandb_project = "relax-test"
clearml_project = "relax-test"
plot = false  # matplotlib would write its font cache into the (sandboxed, checked) home directory
"""


def test_a_tiny_run_reads_back_from_wandb_and_clearml(tiny_model_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    job = tmp_path / "job"
    spec = parse_spec(tiny_spec_text(tiny_model_dir, job, steps=3, name="trackers", extra=TRACKERS))
    with offline_sandbox(monkeypatch, tmp_path / "home"):
        run_job(spec, in_process=True, progress=False)

    curve = {int(row["step"]): row["reward/mean"] for row in read_metrics(job / "metrics.jsonl")}
    assert sorted(curve) == [1, 2, 3]
    wandb, clearml = read_wandb_history(job), read_clearml_scalars(job)
    assert {step: m["reward/mean"] for step, m in wandb.items()} == curve
    assert {step: m["reward/mean"] for step, m in clearml.items()} == curve
    assert wandb[3].keys() == clearml[3].keys()  # every scalar of a step, in both
    summary = json.loads((job / "summary.json").read_text())
    assert summary["metrics/sink_failures"] == {"jsonl": 0, "tensorboard": 0, "wandb": 0, "clearml": 0}
