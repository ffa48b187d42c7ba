"""`relax-hpc convert` of a Megatron backend checkpoint, through megatron-bridge, on CPU.

The Megatron environment's python (tools/setup-megatron-cpu) trains the tiny Qwen3 one step with
MegatronBackend (tests/backends/megatron_backend_check.py's ``save`` scenario, TP=1) and saves it
into a job directory; that environment's `relax-hpc convert` writes the HF directory, which this
venv's transformers loads. The weights must be those the backend held after its step, as the
bridge exported them live. Skipped without the environment unless RELAX_TEST_MEGATRON=1.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from side_env import MEGATRON, REPO, run_json_script, side_process_env

CHECK_SCRIPT = REPO / "tests" / "backends" / "megatron_backend_check.py"
TIMEOUT_S = 600  # ~25 s alone on 2 cores; far longer beside a busy CI

pytestmark = [pytest.mark.slow, pytest.mark.megatron]


@pytest.fixture(scope="module")
def megatron_python() -> Path:
    return MEGATRON.python_or_skip()


@pytest.fixture(scope="module")
def megatron_job(megatron_python: Path, tiny_model_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A job directory (spec.toml, checkpoints/step_1) and the weights the backend held at step 1."""
    job = tmp_path_factory.mktemp("megatron_job")
    spec = (REPO / "jobspecs" / "tiny_megatron.toml").read_text()
    (job / "spec.toml").write_text(spec.replace('"runs/models/tiny-qwen3"', f'"{tiny_model_dir}"', 1))
    run_json_script(megatron_python, CHECK_SCRIPT, "save", "--model", str(tiny_model_dir), "--ranks", "1",
                    "--tp", "1", "--ckpt", str(job / "checkpoints"), "--out", str(job / "trained.pt"),
                    timeout_s=TIMEOUT_S)
    trained = torch.load(job / "trained.pt", weights_only=False)["tensors"]["weights"]
    return {"job": job, "checkpoint": job / "checkpoints" / "step_1", "trained": trained}


@pytest.fixture(scope="module")
def converted(megatron_python: Path, megatron_job: dict[str, Any]) -> Path:
    out = megatron_job["job"] / "hf"
    done = subprocess.run([str(megatron_python.parent / "relax-hpc"), "convert", str(megatron_job["job"]), str(out)],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=side_process_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, f"relax-hpc convert exited {done.returncode}:\n{done.stdout}\n{done.stderr[-6000:]}"
    assert done.stdout.strip().splitlines()[-1] == f"wrote {out}"
    return out


def test_convert_writes_the_weights_the_megatron_backend_trained(
    converted: Path, megatron_job: dict[str, Any], tiny_model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(converted, local_files_only=True).state_dict()
    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).state_dict()
    trained: dict[str, torch.Tensor] = megatron_job["trained"]
    assert len(trained) == 24 and set(trained) <= set(exported)  # every HF tensor the bridge names
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor), name
        assert not torch.equal(source[name], tensor), name  # the step moved it
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()


def test_without_megatron_the_export_names_the_environment_that_converts(
    megatron_job: dict[str, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from relax_hpc.ckpt.export import export_hf
    from relax_hpc.ckpt.formats import checkpoint_backend
    from relax_hpc.launch.convert import export_checkpoint

    checkpoint = megatron_job["checkpoint"]
    assert checkpoint_backend(checkpoint) == "megatron"
    with pytest.raises(ValueError, match=r"written by the megatron backend.*relax-hpc convert"):
        export_hf(checkpoint, tiny_model_dir, tmp_path / "out")
    if importlib.util.find_spec("megatron") is not None:
        return  # a venv with megatron converts it; the project's has none (the bridge needs transformers < 5)
    with pytest.raises(ValueError, match=r"needs megatron-core and megatron-bridge.*tools/setup-megatron-cpu"):
        export_checkpoint(checkpoint, tiny_model_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
