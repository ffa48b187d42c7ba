"""`relax-hpc rehearse` end to end: a production spec through run, resume and export on CPU, as a
user runs it (a subprocess of the CLI; its runs are subprocesses of their own).

The shipped production specs rehearse in `test_production_spec_rehearses`, which runs only with
`RELAX_REHEARSE_PRODUCTION=1`: OPT_IN says, for each, how far its rehearsal got on 2026-12-02 and
why it is not in the default suite yet (a run longer than the
per-test budget: two `relax-hpc run`s that each start two SGLang servers). What runs by default is
the DAPO spec on the embedded engine and backend (its own comment: set engine = "native",
backend = "torch"): the same columns, reward, algorithm, dynamic sampling, async mode and
staleness, two trainer ranks and two engines behind the router, through run, resume and export.

    RAY_AUTH_MODE=disabled .venv/bin/python -m pytest tests/launch/test_rehearse_e2e.py -q
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from side_env import MEGATRON, SGLANG

REPO = Path(__file__).resolve().parents[2]
OPT_IN = {  # spec -> how far its rehearsal got (2026-12-02, 2 cores shared with other work)
    "qwen3_4b_dapo": "passes (bf16 with the CPU optimizer's float32 masters, Megatron TP = 2, 2 SGLang engines, "
                     "export through the bridge) in ~7 min: over the per-test budget",
    "qwen3_vl_4b_openr1": "passes with the FSDP2 multimodal wrapping (backends/parallel.py), in ~15 min: "
                          "over the per-test budget",
    "qwen3_omni": "passes (FSDP2 over the omni thinker, 2 SGLang engines on image and audio rows, export with "
                  "the omni layout) in ~5 min: over the per-test budget",
}
NEEDS = {"qwen3_4b_dapo": (SGLANG, MEGATRON), "qwen3_vl_4b_openr1": (SGLANG,), "qwen3_omni": (SGLANG,)}
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


@pytest.mark.parametrize("name", sorted(OPT_IN))
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_production_spec_rehearses(name: str, tmp_path: Path) -> None:
    if os.environ.get("RELAX_REHEARSE_PRODUCTION") != "1":
        needs = " and ".join(env.name for env in NEEDS[name])
        pytest.skip(f"opt-in, not a pass: {OPT_IN[name]}; RELAX_REHEARSE_PRODUCTION=1 runs it (needs {needs})")
    for env in NEEDS[name]:
        env.python_or_skip()
    done = _rehearse(REPO / "jobspecs" / f"{name}.toml", tmp_path / "rehearsal")
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0 and last.startswith(f"rehearsal passed: {REPO / 'jobspecs'}"), last
