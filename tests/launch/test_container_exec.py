"""The container prefix at work: a rendered WRAP array run by bash, with stand-in `apptainer` and
`singularity` executables that record their arguments and the environment they were given."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from relax_hpc.launch.container import JOB_ENV, render_wrapper
from relax_hpc.spec import ContainerSpec

# Writes its argv and the APPTAINERENV_/SINGULARITYENV_ variables it sees, as JSON.
RECORDER = f"""#!{sys.executable}
import json, os, sys
handed = {{k: v for k, v in os.environ.items() if k.startswith(("APPTAINERENV_", "SINGULARITYENV_"))}}
print(json.dumps({{"argv0": os.path.basename(sys.argv[0]), "args": sys.argv[1:], "env": handed}}))
"""


def run_wrapped(tmp_path: Path, binaries: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The rendered lines run with PATH = only a directory of `binaries` (recorders), bash and hostname,
    so a container runtime installed on this machine is never the one found."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in binaries:
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    for tool in ("bash", "hostname"):  # what the rendered lines run besides the runtime
        (bin_dir / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
    container = ContainerSpec(image="/img/relax.sif", binds=["/data:/d:ro"], env=["W=1"])
    script = (f"JOB_DIR=/jobs/7\nSLURM_SUBMIT_DIR=/home/u\n{render_wrapper('trainer', container, 8)}\n"
              '"${WRAP_trainer[@]}" python3 -m relax_hpc.cli.main run spec.toml\n')
    base = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return subprocess.run([shutil.which("bash") or "/bin/bash", "-c", script], env={**base, **env}, capture_output=True, text=True)


def test_apptainer_gets_cleanenv_and_only_the_jobs_variables_with_commas_intact(tmp_path: Path) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_NODEID": "3", "RAY_AUTH_MODE": "token",
           "RELAX_HPC_SECRET_FILE": "/jobs/7/.secret", "WANDB_API_KEY": "host-secret", "OTHER": "x"}
    done = run_wrapped(tmp_path, ["apptainer", "singularity"], env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv0"] == "apptainer"
    assert seen["args"] == ["exec", "--cleanenv", "--nv", "--bind", "/jobs/7", "--bind", "/home/u", "--bind",
                            "/data:/d:ro", "--env-file", "/jobs/7/container.env", "/img/relax.sif",
                            "python3", "-m", "relax_hpc.cli.main", "run", "spec.toml"]
    # Exactly the job's variables that are set, each as it was in this task (0,1 stays one value).
    assert seen["env"] == {"APPTAINERENV_CUDA_VISIBLE_DEVICES": "0,1", "APPTAINERENV_SLURM_NODEID": "3",
                           "APPTAINERENV_RAY_AUTH_MODE": "token",
                           "APPTAINERENV_RELAX_HPC_SECRET_FILE": "/jobs/7/.secret"}
    assert set(name.removeprefix("APPTAINERENV_") for name in seen["env"]) <= set(JOB_ENV)


def test_singularity_is_used_when_only_it_exists(tmp_path: Path) -> None:
    done = run_wrapped(tmp_path, ["singularity"], {"SLURM_PROCID": "0"})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv0"] == "singularity" and seen["args"][:2] == ["exec", "--cleanenv"]
    assert seen["env"] == {"SINGULARITYENV_SLURM_PROCID": "0"}


def test_no_runtime_names_the_problem(tmp_path: Path) -> None:
    done = run_wrapped(tmp_path, [], {})
    assert done.returncode == 127
    assert "neither apptainer nor singularity is on PATH" in done.stderr and "[slurm] setup" in done.stderr
    assert os.path.basename(done.stdout.strip() or "-") == "-"
