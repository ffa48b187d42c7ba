"""The Megatron critic (`[critic] backend = "megatron"`) at TP=2 against the torch critic, and its checkpoint.

One launch of tests/backends/megatron_critic_check.py with the Megatron environment's python: two
gloo ranks hold one tensor-parallel replica of the value model, take two critic steps on the rows
a torch critic takes them on, from the same weights (the tiny model and one non-zero value head),
save and load their checkpoint. Skips without that environment, as tests/side_env.py says
(RELAX_TEST_MEGATRON=1 makes the environment's own test fail instead). About 20 s on 2 cores.
Then PPO as a Megatron user runs it: `relax-hpc run` of jobspecs/tiny_megatron.toml with
`advantage = "gae"` on Ray, the actor one rank and the critic data parallel over 2 ranks (its other
layout; three ranks in all; the actor's TP=2 under Ray is tests/backends/test_megatron_backend.py's
learning run).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from side_env import MEGATRON, REPO, run_json_script, side_process_env

CHECK_SCRIPT = Path(__file__).with_name("megatron_critic_check.py")
TOLERANCE = 1e-5  # float32 on the same weights: observed <= 3e-6 (advantages), 1.2e-6 (values)

pytestmark = [pytest.mark.slow, pytest.mark.megatron]


@pytest.fixture(scope="module")
def launch(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    python = MEGATRON.python_or_skip()
    out = tmp_path_factory.mktemp("megatron_critic")
    return run_json_script(python, CHECK_SCRIPT, "--model", str(tiny_model_dir), "--out", str(out), timeout_s=600)


def test_a_tp2_megatron_critic_values_and_steps_as_the_torch_critic(launch: dict[str, Any]) -> None:
    # One replica of two TP ranks: both take every row, rank 0 writes the advantages.
    assert launch["data"] == [0, 1] and launch["writes_rows"] is True
    assert launch["values_max"] > 0.1  # the non-zero head: values worth comparing
    assert launch["values_diff"] < TOLERANCE, launch
    for step in launch["steps"]:
        assert step["advantage_rows"] == [0, 1, 2, 3, 4]
        assert step["advantages_diff"] < TOLERANCE, step
        assert step["head_grad_max"] > 1e-2 and step["head_grad_diff"] < TOLERANCE, step
        for key, (ours, theirs) in step["stats"].items():
            assert ours == pytest.approx(theirs, rel=TOLERANCE, abs=TOLERANCE), key
    # The second step's gradient norm covers the decoder too (the head alone is ~0.2 of it), and
    # after both steps (AdamW at lr 1e-2) the values moved by ~2 and still agree.
    assert launch["steps"][1]["stats"]["critic/grad_norm"][1] > 1.0
    assert launch["trained_moved"] > 0.5
    assert launch["trained_diff"] < TOLERANCE, launch


def test_a_megatron_critic_checkpoint_loads_exactly_its_weights_and_moments(launch: dict[str, Any]) -> None:
    resumed = launch["resumed"]
    assert resumed["fresh_diff"] > 0.5  # a fresh critic values the rows otherwise
    assert resumed["values_diff"] == 0.0 and resumed["moments_equal"] and resumed["moments_nonzero"], resumed
    assert launch["meta"] == {"step": 2, "backend": "megatron", "num_processes": 2}
    assert launch["listing"] == ["step_2"]  # renamed from tmp_step_2
    assert {".metadata", "metadata.json", "common.pt"} <= set(launch["files"])  # dist_checkpointing's layout


def _megatron_ppo_spec(tmp_path: Path) -> Path:
    """jobspecs/tiny_megatron.toml with a critic: the actor's backend (unset: inherited), two
    replicas of TP=1; the actor one rank of TP=1."""
    text = (REPO / "jobspecs" / "tiny_megatron.toml").read_text()
    for old, new in (('name = "tiny_megatron"\n', f'name = "tiny_megatron"\noutput_dir = "{tmp_path / "job"}"\n'),
                     ('"runs/models/tiny-qwen3"', f'"{tmp_path / "model"}"'),
                     ("max_staleness = 0\n", 'max_staleness = 0\nadvantage = "gae"\n'),
                     ("steps = 60\n", "steps = 2\n"), ("save_interval = 50\n", "save_interval = 2\n"),
                     # One actor rank: the actor's TP=2 under Ray is test_megatron_backend.py's
                     # learning run; a second actor rank here cost a Megatron start-up for nothing new.
                     ("num_processes = 2 ", "num_processes = 1 "), ("tensor_parallel = 2\n", "tensor_parallel = 1\n")):
        assert old in text, old
        text = text.replace(old, new, 1)
    spec = tmp_path / "tiny_megatron_ppo.toml"
    spec.write_text(text + "\n[critic]\nnum_processes = 2\nlr = 1e-3\nmicro_batch_size = 256\nwarmup_steps = 1\n"
                    "\n[critic.megatron]\ntensor_parallel = 1\n")
    return spec


def test_a_megatron_actor_and_critic_run_ppo_on_ray_and_checkpoint_both(tmp_path: Path) -> None:
    python = MEGATRON.python_or_skip()
    done = subprocess.run([str(python.parent / "relax-hpc"), "run", str(_megatron_ppo_spec(tmp_path)), "--no-progress"],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=side_process_env(RAY_AUTH_MODE="disabled"))
    assert done.returncode == 0, f"relax-hpc run exited {done.returncode}:\n{done.stderr[-6000:]}"
    job = tmp_path / "job"
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # Step 1 warms the critic up (its fresh head values everything 0); step 2 trains the Megatron
    # actor on the advantages both critic replicas wrote for their rows, from values the warm-up moved.
    assert rows[0]["critic/warmup"] == 1.0 and rows[0]["critic/values_mean"] == 0.0
    assert "train/loss/policy" not in rows[0]
    assert rows[1]["critic/warmup"] == 0.0 and rows[1]["critic/values_mean"] != 0.0
    assert "train/loss/policy" in rows[1] and rows[1]["critic/grad_norm"] > 0
    assert sorted(p.name for p in (job / "checkpoints_critic").iterdir()) == ["step_2"]
    meta = json.loads((job / "checkpoints_critic" / "step_2" / "critic.json").read_text())
    assert meta == {"step": 2, "backend": "megatron", "num_processes": 2}
    assert (job / "checkpoints_critic" / "step_2" / "critic" / "metadata.json").is_file()  # dist_checkpointing's
    assert sorted(p.name for p in (job / "checkpoints").iterdir()) == ["latest", "step_2"]
