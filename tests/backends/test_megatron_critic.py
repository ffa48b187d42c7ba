"""The Megatron critic (`[critic] backend = "megatron"`) at TP=2 against the torch critic, and its checkpoint.

One launch of tests/backends/megatron_critic_check.py with the Megatron environment's python: two
gloo ranks hold one tensor-parallel replica of the value model, take two critic steps on the rows
a torch critic takes them on, from the same weights (the tiny model and one non-zero value head),
save and load their checkpoint. Skips without that environment, as tests/side_env.py says
(RELAX_TEST_MEGATRON=1 makes the environment's own test fail instead). About 20 s on 2 cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from side_env import MEGATRON, run_json_script

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
