"""megatron-core runs the tiny Qwen3 on CPU, loaded and exported by megatron-bridge, and agrees with HF.

The slow tests need the environment that tools/setup-megatron-cpu builds (.venv-megatron, or
$RELAX_MEGATRON_ENV); they run tests/backends/megatron_logits_check.py with its python at TP=1
and at TP=2 (two gloo processes). Without it they skip, unless RELAX_TEST_MEGATRON=1, which makes
a missing environment a failure. About a minute on 2 cores:

    RELAX_TEST_MEGATRON=1 .venv/bin/python -m pytest tests/backends/test_megatron_cpu.py -q

The fast tests check relax_hpc.backends.megatron_cpu in the project venv, without megatron.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from side_env import MEGATRON, REPO, run_json_script

# fp32 Megatron (local layer spec) vs HF on the same weights; observed ~2e-7.
TOL = 1e-5
CHECK_SCRIPT = Path(__file__).with_name("megatron_logits_check.py")
CHECK_TIMEOUT_S = 300  # ~20-30 s alone on 2 cores, several times that beside a busy CI


def test_megatron_cpu_imports_without_megatron_and_does_nothing_off_cpu() -> None:
    # A fresh interpreter, so no other test's imports count; megatron is not in the project venv.
    code = (
        "import sys, torch\n"
        "current_device = torch.cuda.current_device\n"
        "from relax_hpc.backends import megatron_cpu\n"
        "assert not any(m.split('.')[0] == 'megatron' for m in sys.modules), 'megatron imported'\n"
        "assert megatron_cpu.activate('cuda') == [] and megatron_cpu.activate(torch.device('meta')) == []\n"
        "assert torch.cuda.current_device is current_device, 'torch.cuda was patched'\n"
        "assert not any(m.split('.')[0] == 'megatron' for m in sys.modules), 'megatron imported'\n"
        "mask = megatron_cpu.causal_mask(3)\n"
        "assert mask.shape == (1, 1, 3, 3) and mask[0, 0].tolist() == "
        "[[False, True, True], [False, False, True], [False, False, False]]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


@pytest.mark.slow
@pytest.mark.megatron
def test_the_megatron_environment_is_built() -> None:
    MEGATRON.require_built()


@pytest.fixture(scope="module")
def megatron_python() -> Path:
    return MEGATRON.python_or_skip()


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_matches_hf_and_exports_exactly(
    megatron_python: Path, tiny_model_dir: Path, tp: int
) -> None:
    result = _run_check(megatron_python, tiny_model_dir, tp)
    assert result["tp"] == tp
    assert result["versions"]["transformers"].startswith("4."), result["versions"]
    assert result["versions"]["torch"].endswith("+cpu"), result["versions"]
    assert result["rotary_base"] == result["hf_rope_theta"]
    assert len(result["routes"]) == 6, result["routes"]  # see megatron_cpu.py: one per route
    assert result["megatron_vocab"] == result["hf_vocab"]
    assert result["logits_max_abs_diff"] < TOL, result
    assert result["logprob_max_abs_diff"] < TOL, result
    assert result["entropy_max_abs_diff"] < TOL, result
    assert result["export_tensors"] > 0
    assert result["export_missing"] == result["export_extra"] == result["export_not_equal"] == [], result


def _run_check(python: Path, model_dir: Path, tp: int) -> dict[str, Any]:
    return run_json_script(python, CHECK_SCRIPT, "--model", str(model_dir), "--tp", str(tp),
                           timeout_s=CHECK_TIMEOUT_S)
