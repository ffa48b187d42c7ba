"""A non-editable wheel install renders and runs the embedded specs from any directory.

The venv comes from the `wheel_venv` fixture (tests/wheel_venv.py). Every command runs from
tmp_path, away from the checkout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from wheel_venv import check as _check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


def test_render_of_the_embedded_slurm_spec_matches_the_golden_file(
        wheel_venv: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    bin_dir, env = wheel_venv
    env = {k: v for k, v in env.items() if k != "RELAX_HPC_SBATCH_DIR"}  # the template from the wheel
    done = _check([str(bin_dir / "relax-hpc"), "render", "tiny_slurm", "--job-dir", "/shared/runs/tiny_slurm"],
                  tmp_path, env)
    assert done.stdout == (REPO / "tests" / "launch" / "golden" / "tiny_slurm.sbatch").read_text()
    _check([str(bin_dir / "relax-hpc"), "validate", "tiny_local"], tmp_path, env)


def test_run_of_the_embedded_spec_from_any_directory(wheel_venv: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    bin_dir, env = wheel_venv
    relax_hpc = str(bin_dir / "relax-hpc")
    shown = _check([relax_hpc, "show", "tiny_local"], tmp_path, env).stdout
    spec = tmp_path / "tiny_short.toml"  # the embedded spec with 3 steps, its data still in the wheel
    # (show notes where each given value came from: "steps = 400  # .../tiny_local.toml:38")
    spec.write_text(re.sub(r"(?m)^steps = \d+(  # .*)?$", "steps = 3", shown))
    env = {**env, "RELAX_HPC_PROGRESS_EVERY_S": "0"}
    done = _check([relax_hpc, "run", str(spec)], tmp_path, env)
    summary = json.loads((tmp_path / "runs" / "tiny_local" / "summary.json").read_text())
    assert summary["end_step"] == 3, summary
    # stderr is a pipe, not a terminal: plain progress lines instead of a redrawn bar.
    assert "\r" not in done.stderr
    assert re.search(r"(?m)^step 3/3  reward \d\.\d{3}  \d+\.\d\d s/step  ", done.stderr), done.stderr


def test_the_wheel_ships_every_example_spec_and_its_data(wheel_venv: tuple[Path, dict[str, str]],
                                                         tmp_path: Path) -> None:
    bin_dir, env = wheel_venv
    listing = _check([str(bin_dir / "python"), "-c", "from relax_hpc.jobspecs import embedded_dir, embedded_names; "
                      "import json; d = embedded_dir(); print(json.dumps([embedded_names(), "
                      "sorted(p.name for p in (d / 'data').iterdir()), str(d)]))"], tmp_path, env)
    names, data, where = json.loads(listing.stdout)
    assert names == sorted(p.stem for p in (REPO / "jobspecs").glob("*.toml"))
    assert data == sorted(p.name for p in (REPO / "jobspecs" / "data").iterdir())
    assert "site-packages" in where  # the installed copy, not the checkout
    # An example whose data lies beside it runs its checks from any directory.
    shown = _check([str(bin_dir / "relax-hpc"), "validate", "agent_calculator"], tmp_path, env)
    assert "agent_calculator.toml: ok" in shown.stdout
