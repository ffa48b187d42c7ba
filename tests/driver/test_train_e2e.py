"""End-to-end runs of the training loop on the tiny task (CPU)."""

from __future__ import annotations

import json
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
import torch

from e2e_helpers import LEARN_LR, LEARN_STEPS, REPO, tiny_spec_text
from relax_hpc.driver.run import run_job
from relax_hpc.models.hf import load_causal_lm
from relax_hpc.ops.metrics import read_metrics
from relax_hpc.spec import parse_spec

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}


def test_reward_rises_and_every_parameter_changes(tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = parse_spec(tiny_spec_text(tiny_model_dir, tmp_path / "job", steps=LEARN_STEPS, save_interval=LEARN_STEPS,
                                     lr=LEARN_LR))
    report = run_job(spec, in_process=True, progress=False)

    rewards = report.result.rewards
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    # A random policy answers ~1-2% right; LEARN_STEPS GRPO steps lift it well above that.
    assert first < 0.05
    assert last > 3 * first and last > 0.08, (first, last)

    before = load_causal_lm(tiny_model_dir)
    after = load_causal_lm(tiny_model_dir)
    from relax_hpc.ckpt import CheckpointManager

    opt = torch.optim.AdamW(after.parameters())
    state = CheckpointManager(tmp_path / "job" / "checkpoints").load_latest(after, opt)
    assert state is not None and state.step == LEARN_STEPS
    assert state.samples_trained == LEARN_STEPS * 16 * 16
    unchanged = [n for (n, p), (_, q) in zip(before.named_parameters(), after.named_parameters())
                 if torch.equal(p, q)]
    assert unchanged == [], f"parameters not trained: {unchanged}"
    assert (tmp_path / "job" / "reward_curve.png").stat().st_size > 1000
    assert list((tmp_path / "job" / "tensorboard").glob("events.out.tfevents.*"))


# Heartbeats every 0.5 s, so that a watch of a few seconds of steps sees every role beating.
HEARTBEATS = "[health]\nheartbeat_s = 0.5\nstale_s = 5\n"


def _two_sharded_trainer_processes(spec_text: str) -> str:
    return spec_text.replace("micro_batch_size = 256", 'micro_batch_size = 64\nnum_processes = 2\nstrategy = "fsdp2"')


def _blocks(stream: IO[str]) -> Iterator[str]:
    """Each refresh of `status --watch` into a pipe (a time line, then the status) as one string."""
    block: list[str] = []
    for line in iter(stream.readline, ""):
        if line.startswith("---- ") and block:
            yield "".join(block)
            block = []
        block.append(line)


def _shows_live_run(block: str) -> bool:
    """A refresh showing the run running, at a step, with a fresh heartbeat (pid, host and age) of
    the driver, the rollout and a trainer rank."""
    step = re.search(r"(?m)^  step +(\d+)/\d+\b", block)
    beating = set(re.findall(r"(?m)^    (\S+) +running +pid \d+ +\S+ +beat ", block))
    return ("state      running" in block and step is not None and int(step.group(1)) >= 1
            and {"driver", "rollout", "trainer_rank_0"} <= beating)


def _stop(proc: subprocess.Popen[str] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=60)  # drained, it can flush and exit
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def test_two_trainer_processes_checkpoint_on_sigterm_and_the_same_command_resumes(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    # One run for four behaviours (each needed a Ray start of its own before): a signal makes the
    # driver checkpoint and stop, and the same command resumes; two trainer processes train as
    # FSDP2 ranks over gloo and save each checkpoint collectively, sharded; the resumed run
    # gathers the restored shards and pushes them to the engine before it trains on
    # (tests/driver/test_sglang_e2e.py's FSDP2 learning run has no second run for it); and
    # `relax-hpc status --watch` follows the first run live, `relax-hpc status` shows the resumed
    # one finished. A single trainer's resume is the Slurm requeue tests' and the fault suite's,
    # two data-parallel (DDP) ranks' the fault suite's kill-trainer-rank run (docs/testing.md).
    job = tmp_path / "job"
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(_two_sharded_trainer_processes(
        tiny_spec_text(tiny_model_dir, job, steps=400, save_interval=1000, extra=HEARTBEATS)))
    cli = [sys.executable, "-m", "relax_hpc.cli.main"]
    cmd = [*cli, "run", str(spec_path), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = job / "metrics.jsonl"
    deadline = time.time() + 240  # only against a hang: nothing below asserts how long anything took
    watcher: subprocess.Popen[str] | None = None
    live: str | None = None
    last = ""
    try:
        while not job.is_dir():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.time() < deadline, "the run made no job directory"
            time.sleep(0.2)
        watcher = subprocess.Popen([*cli, "status", str(job), "--watch", "--every", "0.2"], cwd=REPO,
                                   env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert watcher.stdout is not None
        for last in _blocks(watcher.stdout):
            live = live or (last if _shows_live_run(last) else None)
            if (live and len(read_metrics(metrics)) >= 3) or time.time() > deadline:
                break
            assert proc.poll() is None, proc.communicate()[1]
    finally:
        _stop(watcher)
    assert watcher.returncode == 0  # Ctrl-C ends a watch normally
    assert live is not None, f"no refresh showed a running step with beating roles; the last:\n{last}"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "SIGTERM received" in err
    stopped_at = int(out.split("stopped early at step ")[1].split()[0])
    assert stopped_at >= 3
    # save_interval is 1000: the checkpoint at stopped_at exists only because of the signal.
    assert (job / "checkpoints" / f"step_{stopped_at}").is_dir()

    spec_path.write_text(_two_sharded_trainer_processes(
        tiny_spec_text(tiny_model_dir, job, steps=stopped_at + 2, save_interval=1000, extra=HEARTBEATS)))
    again = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"finished step {stopped_at + 2} (from {stopped_at})" in again.stdout
    # The resumed run continues the step count, the weight versions and the samples trained (this
    # test also stands for the one that resumed a finished run with more steps: the same load of
    # the newest checkpoint, docs/testing.md).
    records = read_metrics(metrics)
    assert [int(r["step"]) for r in records] == list(range(1, stopped_at + 3))
    assert [r["weight_version"] for r in records] == list(range(1, stopped_at + 3))
    summary = json.loads((job / "summary.json").read_text())
    assert summary["samples_trained"] == (stopped_at + 2) * 16 * 16
    # Both ranks saved collectively, at the signal and at the end: complete checkpoints of both.
    from relax_hpc.ckpt import read_resume_file

    for step in (stopped_at, stopped_at + 2):
        resume = read_resume_file(job / "checkpoints" / f"step_{step}")
        assert resume.world_size == 2 and resume.state.step == step

    final = subprocess.run([*cli, "status", str(job)], cwd=REPO, env=_env(), capture_output=True, text=True,
                           timeout=120)
    assert final.returncode == 0, final.stderr
    assert "state      finished" in final.stdout, final.stdout
    assert f"checkpoint step_{stopped_at + 2} ({job / 'checkpoints' / f'step_{stopped_at + 2}'})" in final.stdout
    # After the end nothing beats: no role is called stale, every one has ended.
    assert not re.search(r"(?m)^    \S+ +stale ", final.stdout), final.stdout
    assert re.search(r"(?m)^    rollout +ended ", final.stdout), final.stdout


def test_async_mode_with_staleness_zero_matches_colocate(tiny_model_dir: Path, tmp_path: Path) -> None:
    colocate = parse_spec(tiny_spec_text(tiny_model_dir, tmp_path / "colocate", steps=30, save_interval=30))
    text = tiny_spec_text(tiny_model_dir, tmp_path / "async", steps=30, save_interval=30)
    text = text.replace('[job]\nname = "e2e"', '[job]\nname = "e2e"\nmode = "async"')
    asynchronous = parse_spec(text)
    assert asynchronous.job.mode == "async" and asynchronous.algorithm.max_staleness == 0
    a = run_job(colocate, in_process=True, progress=False).result.rewards
    b = run_job(asynchronous, in_process=True, progress=False).result.rewards
    # Same loop, same pacing: with max_staleness = 0 the two modes are the same computation.
    assert a == b


def test_forward_roles_supply_old_and_reference_log_probs(tiny_model_dir: Path, tmp_path: Path) -> None:
    text = tiny_spec_text(tiny_model_dir, tmp_path / "job", steps=6, save_interval=6)
    text = text.replace('name = "grpo"', 'name = "grpo"\nkl_coef = 0.05')
    text = text.replace("micro_batch_size = 256", "micro_batch_size = 64\nactor_fwd_role = true\nreference_role = true")
    report = run_job(parse_spec(text), in_process=True, progress=False)
    assert report.result.end_step == 6
    rows = read_metrics(tmp_path / "job" / "metrics.jsonl")
    # The KL term is computed from the Reference role's field (the trainer keeps no copy), and
    # grows from 0 as the policy moves away from the initial model.
    assert rows[0]["train/loss/kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[-1]["train/loss/kl"] > 1e-4
    # ActorFwd's old log-probs come from the weights the step starts with: the ratio is 1.
    assert all(r["train/ratio_mean"] == pytest.approx(1.0, abs=1e-4) for r in rows)
