"""`[cluster] colocate = true`: the engine gives its memory to the trainer between steps and takes
new weights back, and training is exactly what it is without the sharing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_helpers import tiny_spec_text

from relax_hpc.ckpt import CheckpointManager
from relax_hpc.driver.run import run_job
from relax_hpc.models.hf import load_causal_lm
from relax_hpc.ops.metrics import read_metrics
from relax_hpc.spec import parse_spec

pytestmark = pytest.mark.slow

STEPS = 4


def _run(model_dir: Path, job: Path, share: bool, ray: bool = False) -> list[dict]:
    extra = "[cluster]\ncolocate = true\n" if share else ""
    spec = parse_spec(tiny_spec_text(model_dir, job, steps=STEPS, save_interval=STEPS, extra=extra))
    run_job(spec, in_process=not ray, progress=False)
    return read_metrics(job / "metrics.jsonl")


def _weights(model_dir: Path, job: Path) -> dict[str, torch.Tensor]:
    model = load_causal_lm(model_dir)
    state = CheckpointManager(job / "checkpoints").load_latest(model, torch.optim.AdamW(model.parameters()))
    assert state is not None and state.step == STEPS
    return dict(model.state_dict())


def test_sharing_devices_frees_the_engine_between_steps_and_trains_the_same_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    plain = _run(tiny_model_dir, tmp_path / "plain", share=False)
    shared = _run(tiny_model_dir, tmp_path / "shared", share=True)

    param_bytes = sum(p.numel() * p.element_size() for p in load_causal_lm(tiny_model_dir).parameters())
    released = [m.get("rollout/released_bytes") for m in shared]
    # Every step but the last hands the engine's weights over; the last has no next step.
    assert released[:-1] == [float(param_bytes)] * (STEPS - 1) and released[-1] is None
    # On CPU the optimizer state already lives in host memory: nothing to move.
    assert [m["train/offloaded_bytes"] for m in shared] == [0.0] * STEPS
    assert all("rollout/released_bytes" not in m and "train/offloaded_bytes" not in m for m in plain)

    # The engine generated every step after the first from weights it had dropped and taken back.
    assert [m["reward/mean"] for m in shared] == [m["reward/mean"] for m in plain]
    want, got = _weights(tiny_model_dir, tmp_path / "plain"), _weights(tiny_model_dir, tmp_path / "shared")
    assert all(torch.equal(want[name], got[name]) for name in want)


@pytest.mark.timeout(600)
def test_sharing_devices_under_ray_binds_the_received_weights_after_the_release(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Under Ray the engine runs on the received flat buffer itself; the release drops it too.
    shared = _run(tiny_model_dir, tmp_path / "ray", share=True, ray=True)
    assert [int(m["step"]) for m in shared] == list(range(1, STEPS + 1))
    assert all(m["rollout/released_bytes"] > 0 for m in shared[:-1])
