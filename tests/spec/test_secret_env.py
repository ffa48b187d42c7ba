"""[container] env values are secrets: `relax-hpc show`, the W&B run config (spec_to_dict) and
spec problems show them as NAME=***."""

from __future__ import annotations

import pytest
from spec_example import spec_with

from relax_hpc.cli.main import main
from relax_hpc.spec import SpecError, parse_spec, spec_to_dict, spec_to_toml

TOKEN = "hf_s3cr3tT0ken"


def test_show_and_run_config_hide_env_values(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    text = spec_with({"container": {"env": [f"HF_TOKEN={TOKEN}", "MODE=fast"]}})
    spec = parse_spec(text)
    assert spec_to_dict(spec)["container"]["env"] == ["HF_TOKEN=***", "MODE=***"]  # W&B's config
    assert TOKEN not in spec_to_toml(spec) and "HF_TOKEN=***" in spec_to_toml(spec)
    assert parse_spec(spec_to_toml(spec)).container.env == ["HF_TOKEN=***", "MODE=***"]  # loads again
    assert f"HF_TOKEN={TOKEN}" in spec_to_toml(spec, redact=False)  # the Slurm job's own copy
    path = tmp_path / "spec.toml"
    path.write_text(text)
    assert main(["show", str(path)]) == 0
    assert TOKEN not in capsys.readouterr().out


def test_problem_of_an_env_value_does_not_print_it() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_with({"container": {"env": ["OK=1", f"HF_TOKEN={TOKEN}\x07"]}}))
    text = str(caught.value)
    assert "container.env" in text and "HF_TOKEN=***" in text and TOKEN not in text


def test_misspelt_env_key_does_not_print_the_value() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(spec_with({"container": {"envs": [f"HF_TOKEN={TOKEN}"]}}))
    assert "container.envs" in str(caught.value) and TOKEN not in str(caught.value)
