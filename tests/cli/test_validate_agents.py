"""`relax-hpc validate` and `submit` see an agent spec's problems as `run` does (exit 2, before
anything starts): a [rollout] code path that does not import, and an agent with env or generate."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relax_hpc.agents.config import agent_code_problems
from relax_hpc.cli.main import main
from relax_hpc.spec import SpecError, load_spec

REPO = Path(__file__).resolve().parents[2]
CALCULATOR = (REPO / "jobspecs" / "agent_calculator.toml").read_text()
ENV_LINE = 'env = "relax_hpc.agents.examples.calculator:CalculatorEnv"'


def _spec(tmp_path: Path, rollout_lines: str) -> Path:
    assert ENV_LINE in CALCULATOR  # the shipped example names its environment on this line
    path = tmp_path / "agent.toml"
    path.write_text(CALCULATOR.replace(ENV_LINE, rollout_lines, 1)
                    .replace('path = "jobspecs/data/', f'path = "{REPO}/jobspecs/data/', 1))
    return path


@pytest.mark.parametrize(("lines", "key", "said"), [
    ('env = "relax_hpc.agents.examples.no_such_module:CalculatorEnv"', "rollout.env",
     r"cannot import module 'relax_hpc\.agents\.examples\.no_such_module'"),
    ('env = "relax_hpc.agents.examples.calculator:NoSuchEnv"', "rollout.env", r"has no attribute 'NoSuchEnv'"),
    ('generate = "relax_hpc.agents.examples.calculator"', "rollout.generate", r'must be "package\.module:Name"'),
], ids=["module", "attribute", "no-colon"])
def test_validate_names_a_code_path_that_does_not_import(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          lines: str, key: str, said: str) -> None:
    assert main(["validate", str(_spec(tmp_path, lines))]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"{re.escape(key)} = .*{said}", err), err


def test_validate_refuses_an_agent_with_an_env(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = ENV_LINE + '\nagent = "relax_hpc.agents.examples.calculator:CalculatorEnv"'
    assert main(["validate", str(_spec(tmp_path, lines))]) == 2
    err = capsys.readouterr().err
    assert "rollout.agent = " in err and "cannot be combined with rollout.env" in err, err


def test_the_shipped_agent_spec_validates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(_spec(tmp_path, ENV_LINE))]) == 0, capsys.readouterr().err
    assert agent_code_problems(load_spec(_spec(tmp_path, ENV_LINE)).rollout) == []


def test_run_refuses_it_the_same_way_before_starting(tmp_path: Path) -> None:
    from relax_hpc.driver.run import check_backends_available

    spec = load_spec(_spec(tmp_path, 'agent = "relax_hpc.agents.examples.nowhere:Agent"'))
    with pytest.raises(SpecError, match=r"rollout\.agent = .*cannot import module"):
        check_backends_available(spec)
