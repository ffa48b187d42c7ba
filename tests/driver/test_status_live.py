"""`relax-hpc status JOBDIR --watch` on a live `relax-hpc run` of the embedded tiny spec (Ray, CPU)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from e2e_helpers import REPO

from relax_hpc.jobspecs import embedded_dir

pytestmark = pytest.mark.slow

# 40 steps of 32 samples: 10-20 s of steps on 2 cores, 50-100 refreshes of the watch (every
# 0.2 s) while the run trains; any one of them showing it live is enough.
STEPS = 40
GUARD_S = 480.0  # only against a hang: nothing below asserts how long anything took


def _env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}


def _small_tiny_spec(model_dir: Path, job_dir: Path) -> str:
    """The embedded tiny_local spec made small, with heartbeats every 0.5 s."""
    text = (embedded_dir() / "tiny_local.toml").read_text()
    edits = [
        (r'(?m)^name = "tiny_local"', f'name = "status_live"\noutput_dir = "{job_dir}"'),
        (r'(?m)^path = "runs/models/tiny-qwen3"', f'path = "{model_dir}"'),
        (r'(?m)^path = "jobspecs/data/tiny_sum.jsonl"', f'path = "{embedded_dir() / "data" / "tiny_sum.jsonl"}"'),
        (r"(?m)^prompts_per_step = \d+", "prompts_per_step = 4"),
        (r"(?m)^n_samples_per_prompt = \d+", "n_samples_per_prompt = 8"),
        (r"(?m)^steps = \d+", f"steps = {STEPS}"),
        (r"(?m)^save_interval = \d+", f"save_interval = {STEPS}"),
        (r"(?m)^trajectory_archive = true", "trajectory_archive = false"),
    ]
    for pattern, replacement in edits:
        text, count = re.subn(pattern, replacement.replace("\\", "\\\\"), text)  # taken literally
        assert count == 1, f"tiny_local.toml changed: {pattern!r} matched {count} times"
    return text + "\n[health]\nheartbeat_s = 0.5\nstale_s = 5\n"


def _blocks(stream: IO[str]) -> Iterator[str]:
    """Each refresh of `status --watch` into a pipe (a time line, then the status) as one string."""
    block: list[str] = []
    for line in iter(stream.readline, ""):
        if line.startswith("---- ") and block:
            yield "".join(block)
            block = []
        block.append(line)


def _step(block: str) -> int | None:
    match = re.search(rf"(?m)^  step +(\d+)/{STEPS}\b", block)
    return int(match.group(1)) if match else None


def _beating(block: str) -> set[str]:
    """The roles of a block with a fresh heartbeat shown: pid, host and age."""
    return set(re.findall(r"(?m)^    (\S+) +running +pid \d+ +\S+ +beat ", block))


def test_status_follows_a_live_run_to_finished(tiny_model_dir: Path, tmp_path: Path) -> None:
    job = tmp_path / "job"
    spec = tmp_path / "spec.toml"
    spec.write_text(_small_tiny_spec(tiny_model_dir, job))
    cli = [sys.executable, "-m", "relax_hpc.cli.main"]
    with open(tmp_path / "run.out", "w") as out, open(tmp_path / "run.err", "w") as err:
        run = subprocess.Popen([*cli, "run", str(spec), "--no-progress"], cwd=REPO, env=_env(),
                               stdout=out, stderr=err)
    deadline = time.monotonic() + GUARD_S
    watcher = None
    try:
        while not job.is_dir():
            assert run.poll() is None, (tmp_path / "run.err").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run made no job directory"
            time.sleep(0.2)
        watcher = subprocess.Popen([*cli, "status", str(job), "--watch", "--every", "0.2"], cwd=REPO, env=_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        live: str | None = None
        last, after_end = "", 0
        assert watcher.stdout is not None
        for last in _blocks(watcher.stdout):
            if live is None and "state      running" in last and (_step(last) or 0) >= 1 \
                    and {"driver", "rollout", "trainer_rank_0"} <= _beating(last):
                live = last
            after_end += run.poll() is not None  # a few more refreshes, then the one-shot status below
            if after_end > 2 or time.monotonic() > deadline:
                break
        assert run.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, \
            (tmp_path / "run.err").read_text()[-3000:]
        assert live is not None, f"no refresh showed a running step with beating roles; the last:\n{last}"
    finally:
        for proc in (watcher, run):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                if proc is watcher:
                    watcher.stdout.read()  # type: ignore[union-attr]  # drained, it can flush and exit
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    assert watcher.returncode == 0  # Ctrl-C ends a watch normally

    final = subprocess.run([*cli, "status", str(job)], cwd=REPO, env=_env(), capture_output=True, text=True,
                           timeout=120)
    assert final.returncode == 0, final.stderr
    assert "state      finished" in final.stdout
    assert f"checkpoint step_{STEPS} ({job / 'checkpoints' / f'step_{STEPS}'})" in final.stdout
    # After the end nothing beats: no role is called stale, every one has ended.
    assert not re.search(r"(?m)^    \S+ +stale ", final.stdout), final.stdout
    assert re.search(r"(?m)^    rollout +ended ", final.stdout), final.stdout
