"""The job specs and the sbatch template shipped inside the package, and how a spec argument finds them."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_hpc.cli.main import main
from relax_hpc.jobspecs import embedded_dir, embedded_names, resolve_spec_path, with_embedded_inputs
from relax_hpc.launch.render import read_template
from relax_hpc.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


def test_the_checkout_paths_link_to_the_one_packaged_copy() -> None:
    # Every example spec ships in the wheel, with the data files the checkout's specs read.
    assert embedded_names() == sorted(p.stem for p in (REPO / "jobspecs").glob("*.toml"))
    assert {"tiny_local", "tiny_slurm", "tiny_sglang", "tiny_megatron", "qwen3_omni"} <= set(embedded_names())
    for name in embedded_names():
        assert (REPO / "jobspecs" / f"{name}.toml").resolve() == embedded_dir() / f"{name}.toml"
    for checkout_data in (REPO / "jobspecs" / "data").iterdir():
        data = embedded_dir() / "data" / checkout_data.name
        assert checkout_data.resolve() == data and data.is_file()
    template = REPO / "relax_hpc" / "launch" / "templates" / "hetjob.sbatch.in"
    assert (REPO / "sbatch" / "hetjob.sbatch.in").resolve() == template


def test_an_existing_file_wins_and_a_name_selects_the_packaged_spec(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    packaged = str(embedded_dir() / "tiny_local.toml")
    for arg in ("tiny_local", "tiny_local.toml", "jobspecs/tiny_local.toml"):
        assert resolve_spec_path(arg) == packaged, arg
    own = tmp_path / "tiny_local.toml"
    own.write_text("# mine\n")
    assert resolve_spec_path("tiny_local.toml") == "tiny_local.toml"  # the file in this directory
    for arg in ("nope", "jobspecs/nope.toml", "other/tiny_local.toml"):
        assert resolve_spec_path(arg) == arg  # left for load_spec to report


def test_an_embedded_spec_reads_its_data_from_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = resolve_spec_path("tiny_local")
    spec = with_embedded_inputs(load_spec(path), path)
    assert Path(spec.data.path) == embedded_dir() / "data" / "tiny_sum.jsonl"
    assert spec.model.path == "runs/models/tiny-qwen3"  # outputs stay under the current directory
    # From a checkout, jobspecs/tiny_local.toml keeps its paths relative to the checkout root.
    checkout = REPO / "jobspecs" / "tiny_local.toml"
    assert with_embedded_inputs(load_spec(checkout), checkout).data.path == "jobspecs/data/tiny_sum.jsonl"


def test_show_of_an_embedded_name_runs_from_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["show", "tiny_local"]) == 0
    shown = tmp_path / "spec.toml"
    shown.write_text(capsys.readouterr().out)
    assert Path(load_spec(shown).data.path) == embedded_dir() / "data" / "tiny_sum.jsonl"
    assert main(["render", "tiny_slurm"]) == 0
    assert "#SBATCH --job-name=tiny_slurm" in capsys.readouterr().out
    assert main(["render", "tiny_slurm_fwd"]) == 0  # three components: trainer, rollout, forward
    assert "# group 2: forward, 1 node(s)" in capsys.readouterr().out


def test_the_template_comes_from_the_package_or_the_override(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.delenv("RELAX_HPC_SBATCH_DIR", raising=False)
    packaged, source = read_template()
    assert source.endswith("hetjob.sbatch.in") and packaged.startswith("#!/bin/bash")
    monkeypatch.setenv("RELAX_HPC_SBATCH_DIR", str(REPO / "sbatch"))  # what the container image sets
    assert read_template()[0] == packaged
    (tmp_path / "hetjob.sbatch.in").write_text("#!/bin/bash\n# {{job_name}}\n")
    monkeypatch.setenv("RELAX_HPC_SBATCH_DIR", str(tmp_path))
    assert read_template() == ("#!/bin/bash\n# {{job_name}}\n", str(tmp_path / "hetjob.sbatch.in"))
