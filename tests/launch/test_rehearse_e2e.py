"""`relax-hpc rehearse` end to end: a production spec through run, resume and export on CPU, as a
user runs it (a subprocess of the CLI; its runs are subprocesses of their own).

The shipped production specs (those that name GPUs) rehearse as they are with
`tools/rehearse-production` (`make rehearse`), about 3 minutes each on 2 quiet cores (two `relax-hpc
run`s that each start two SGLang servers): over the test command's budget, so not part of it
(docs/testing.md, "Budget"); the test below checks which specs it takes. What runs here is
the DAPO spec on the embedded engine and backend (its own comment: set engine = "native",
backend = "torch"): the same columns, reward, algorithm, dynamic sampling, async mode and
staleness, two trainer ranks and two engines behind the router, through run, resume and export.

    RAY_AUTH_MODE=disabled .venv/bin/python -m pytest tests/launch/test_rehearse_e2e.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from relax_hpc.launch.production_specs import names_gpus, production_specs
from relax_hpc.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1500  # two runs (each starting its engines) and an export on 2 busy cores

pytestmark = [pytest.mark.slow]


def _rehearse(spec: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "relax_hpc.cli.main", "rehearse", str(spec), "--out", str(out), *extra]
    return subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _embedded_dapo(tmp_path: Path) -> Path:
    """jobspecs/qwen3_4b_dapo.toml on the embedded native engine and torch backend."""
    text = (REPO / "jobspecs" / "qwen3_4b_dapo.toml").read_text()
    for pattern, new in ((r'(?m)^engine = "sglang"$', 'engine = "native"'),
                         (r'(?m)^backend = "megatron"$', 'backend = "torch"'),
                         (r"(?m)^tensor_parallel = \d+$", "")):  # [train.megatron] is the megatron backend's
        text, count = re.subn(pattern, new, text)
        assert count == 1, f"jobspecs/qwen3_4b_dapo.toml changed: {pattern} no longer matches once"
    path = tmp_path / "qwen3_4b_dapo_embedded.toml"
    path.write_text(text)
    return path


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_dapo_on_the_embedded_backends_rehearses_run_resume_and_export(tmp_path: Path) -> None:
    out = tmp_path / "rehearsal"
    done = _rehearse(_embedded_dapo(tmp_path), out, "--steps", "2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"rehearsal passed: .*qwen3_4b_dapo_embedded\.toml \(2 steps, \d+ changes\)", last), last
    rows = {line.split()[0]: line.split()[1:3] for line in done.stdout.splitlines() if line.startswith("train.")}
    assert rows["train.num_processes"] == ["4", "2"] and rows["train.device"] == ['"cuda"', '"cpu"'], rows
    summary = json.loads((out / "job" / "summary.json").read_text())
    assert (summary["start_step"], summary["end_step"]) == (2, 3)  # the second run resumed at step 2
    engines = summary["rollout_engines"]
    assert len(engines) == 2 and all(e["alive"] for e in engines), engines
    steps = [json.loads(line)["step"] for line in (out / "job" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (out / "hf" / "config.json").is_file() and list((out / "hf").glob("*.safetensors"))
    assert json.loads((out / "hf" / "config.json").read_text())["model_type"] == "qwen3"


def test_the_production_rehearsals_take_every_shipped_spec_that_names_gpus() -> None:
    listed = subprocess.run([str(REPO / "tools" / "rehearse-production"), "--list"], check=True, cwd=REPO,
                            capture_output=True, text=True, timeout=120).stdout.split()
    assert listed == [f"jobspecs/{name}.toml" for name in ("qwen3_4b_dapo", "qwen3_omni", "qwen3_vl_4b_openr1")]
    assert [p.name for p in production_specs(REPO / "jobspecs")] == [Path(name).name for name in listed]
    tiny = load_spec(REPO / "jobspecs" / "tiny_slurm.toml")  # a Slurm spec on CPUs is not a production one
    assert not names_gpus(tiny)
    assert names_gpus(dataclasses.replace(tiny, cluster=dataclasses.replace(
        tiny.cluster, forward=dataclasses.replace(tiny.cluster.trainer, gpus_per_node=1))))
