"""`relax-hpc rehearse` around its runs: refusals before anything is written, the side environments
it runs with, and how a failed stage is reported (its role, its error line). The runs themselves
are tests/launch/test_rehearse_e2e.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_hpc.cli.main import main
from relax_hpc.launch.rehearse import Failure, error_line, failed_role, fresh_work_dir, side_python

REPO = Path(__file__).resolve().parents[2]


def test_a_spec_without_a_readable_model_or_arch_is_refused_before_any_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (REPO / "jobspecs" / "qwen3_vl_4b_openr1.toml").read_text()
    spec = tmp_path / "no_arch.toml"
    spec.write_text("\n".join(line for line in text.splitlines() if not line.startswith("arch = ")))
    out = tmp_path / "rehearsal"
    assert main(["rehearse", str(spec), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "has no config.json readable here" in err and "set arch" in err and "pass --arch" in err
    assert not out.exists()


def test_a_directory_that_is_not_a_rehearsals_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a rehearsal's directory"):
        fresh_work_dir(tmp_path / "mine")
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "rehearsal-spec.toml").write_text("")
    (earlier / "run.log").write_text("old")
    assert list(fresh_work_dir(earlier).iterdir()) == []


def test_side_environments_come_from_their_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = tmp_path / "sglang-env"
    monkeypatch.setenv("RELAX_SGLANG_ENV", str(env))
    assert side_python("RELAX_SGLANG_ENV", ".venv-sglang") is None
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    assert side_python("RELAX_SGLANG_ENV", ".venv-sglang") == str(env / "bin" / "python")


RAY_TRACE = """\
dataset: 64 of 64 rows kept (dropped: none)
Traceback (most recent call last):
ray.exceptions.RayTaskError(RuntimeError): \x1b[36mray::ActorWorker.train_from_queue()\x1b[39m (pid=1, ip=10.0.0.1)
  File "/relax_hpc/backends/megatron_optim.py", line 84, in step
RuntimeError: attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype 'BFloat16'
(raised by trainer rank 0 while training step 0)
"""


@pytest.mark.parametrize("log, role", [
    (RAY_TRACE, "trainer rank 0"),
    (RAY_TRACE.replace("(raised by trainer rank 0 while training step 0)\n", ""), "trainer"),
    ("relax_hpc.roles.errors.RoleDiedError: engine_1 died while generating step 2 (pid 7): killed\n", "engine_1"),
    ("relax-hpc run: [rollout.sglang] python = 'x' is not an executable file\n", "driver"),
    ("RuntimeError: rollout producer failed: EngineHttpError: engine at http://127.0.0.1:1/generate failed after 2 "
     "attempt(s) (last error: HTTP 500: Internal Server Error) (the trainer was waiting for that step's rows)\n",
     "rollout engine"),
])
def test_the_failed_role_is_read_from_the_log(log: str, role: str, tmp_path: Path) -> None:
    path = tmp_path / "run.log"
    path.write_text(log)
    assert failed_role(path) == role


def test_a_failure_names_the_stage_role_error_and_log(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text(RAY_TRACE + "\nsome shutdown line\n")
    assert error_line(log).startswith("RuntimeError: attempting to assign a gradient")
    line = Failure("run", failed_role(log), f"exit 1: {error_line(log)}", log).report("jobspecs/x.toml")
    assert line.startswith("rehearsal failed: jobspecs/x.toml at run (role trainer rank 0): exit 1: RuntimeError:")
    assert line.endswith(f"; log {log}")
