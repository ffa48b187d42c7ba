"""The relax-hpc command line: exit codes and messages a user sees, run as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def relax(*args: str, cwd: Path = REPO, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in drop} | {"RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "relax_hpc.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("spec", sorted((REPO / "jobspecs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_jobspecs_validate(spec: Path) -> None:
    result = relax("validate", str(spec))
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_validate_reports_every_problem_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[job]\nname = "x"\nmode = "colocate"\n[model]\npath = "m"\n[data]\npath = "d.jsonl"\n'
        '[rollout]\ntop_p = 1.5\nn_sample_per_prompt = 4\n[algorithm]\nmax_staleness = 1\n'
        '[reward]\nfunction = "tiny_sum"\n[train]\nsteps = "ten"\n'
    )
    result = relax("validate", str(bad))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    err = result.stderr
    assert f"{bad}:9: rollout.top_p = 1.5" in err
    assert "rollout.n_sample_per_prompt" in err and "n_samples_per_prompt" in err  # did-you-mean
    assert "train.steps" in err and "'ten'" in err
    assert "max_staleness" in err and "colocate" in err


def test_malformed_toml_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "broken.toml"
    bad.write_text('[job]\nname = "x"\nseed = = 3\n')
    result = relax("validate", str(bad))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "line 3" in result.stderr or f"{bad}:3" in result.stderr


def test_missing_spec_file_is_a_clear_error(tmp_path: Path) -> None:
    result = relax("validate", str(tmp_path / "nope.toml"))
    assert result.returncode == 2
    assert "nope.toml" in result.stderr and "Traceback" not in result.stderr


def test_show_prints_the_resolved_spec_with_defaults() -> None:
    result = relax("show", "jobspecs/tiny_local.toml")
    assert result.returncode == 0, result.stderr
    resolved = tomllib.loads(result.stdout)
    assert resolved["rollout"]["top_p"] == 1.0  # a default the file does not set
    assert resolved["train"]["steps"] > 0
    assert resolved["cluster"]["trainer"]["nodes"] == 1


def test_make_tiny_writes_a_loadable_model_and_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    first = relax("make-tiny", str(out))
    assert first.returncode == 0, first.stderr
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    second = relax("make-tiny", str(out))
    assert second.returncode == 2
    assert "already exists" in second.stderr and "Traceback" not in second.stderr


def test_run_with_a_missing_model_says_what_to_do(tmp_path: Path) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text(
        f'[job]\nname = "x"\noutput_dir = "{tmp_path / "job"}"\n[model]\npath = "{tmp_path / "none"}"\n'
        f'[data]\npath = "{REPO / "jobspecs/data/tiny_sum.jsonl"}"\n[reward]\nfunction = "tiny_sum"\n'
        '[train]\nsteps = 1\n'
    )
    result = relax("run", str(spec), "--in-process", "--no-progress")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "no Hugging Face model" in result.stderr and "make-tiny" in result.stderr


def test_run_with_a_missing_dataset_stops_before_ray_naming_the_key_and_the_directory(tmp_path: Path) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text(
        f'[job]\nname = "x"\noutput_dir = "{tmp_path / "job"}"\n[model]\npath = "{tmp_path / "model"}"\n'
        'build_tiny_if_missing = true\n[data]\npath = "data/rows.jsonl"\n[reward]\nfunction = "tiny_sum"\n'
        '[train]\nsteps = 1\n'
    )
    result = relax("run", str(spec), "--no-progress", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (f"dataset data/rows.jsonl does not exist (a relative path is read from the directory the run "
            f"starts in, {tmp_path}); check [data] path") in result.stderr
    assert "Ray" not in result.stderr + result.stdout and not (tmp_path / "model").exists()  # refused first


def test_help_lists_the_commands() -> None:
    result = relax("--help")
    assert result.returncode == 0
    for command in ("run", "validate", "show", "make-tiny", "plot"):
        assert command in result.stdout


@pytest.mark.parametrize("argv", [["--help"], ["validate", "jobspecs/tiny_local.toml"],
                                  ["render", "jobspecs/tiny_slurm.toml"], ["show", "tiny_local"]],
                         ids=lambda argv: argv[0])
def test_commands_that_only_read_specs_do_not_load_torch(argv: list[str]) -> None:
    # --help, validate, render and show answer at once on a login node: torch, Ray and
    # transformers load only for the commands that train, serve or write a model.
    probe = ("import runpy, sys; sys.argv = ['relax-hpc', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('relax_hpc.cli.main', run_name='__main__')\n"
             "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
             "heavy = sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules)\n"
             "print('LOADED', heavy, code)")
    done = subprocess.run([sys.executable, "-c", probe, *argv], cwd=REPO, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == "LOADED [] 0", done.stdout + done.stderr


def test_run_refuses_a_backend_this_build_does_not_have(tmp_path: Path) -> None:
    spec = tmp_path / "s.toml"
    spec.write_text(
        f'[job]\nname = "x"\noutput_dir = "{tmp_path / "job"}"\n[model]\npath = "{tmp_path / "m"}"\n'
        f'[data]\npath = "{REPO / "jobspecs/data/tiny_sum.jsonl"}"\n[rollout]\nengine = "sglang"\n'
        '[reward]\nfunction = "tiny_sum"\n[train]\nsteps = 1\n'
    )
    # No SGLang environment beside this one: `make test` points RELAX_SGLANG_ENV at .venv-sglang.
    result = relax("run", str(spec), "--in-process", "--no-progress", drop=("RELAX_SGLANG_ENV",))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    # This interpreter has no SGLang and [rollout.sglang] python is unset.
    assert 'rollout.engine = "sglang" but' in result.stderr and "[rollout.sglang] python" in result.stderr
    assert not (tmp_path / "job").exists()  # refused before anything was written
