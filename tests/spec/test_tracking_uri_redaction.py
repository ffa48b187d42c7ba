"""A password in [metrics] mlflow_tracking_uri never reaches show, spec.toml or a tracker's params."""

from __future__ import annotations

from spec_example import spec_with

from relax_hpc.spec import parse_spec, spec_to_toml
from relax_hpc.spec.render import spec_to_dict
from relax_hpc.spec.secret_urls import redact_userinfo


def test_the_password_is_hidden_and_the_host_stays_readable() -> None:
    assert redact_userinfo("https://ann:s3cret@mlflow.site:5000/path") == "https://ann:***@mlflow.site:5000/path"
    assert redact_userinfo("https://mlflow.site") == "https://mlflow.site"
    assert redact_userinfo("file:///scratch/mlruns") == "file:///scratch/mlruns"


def test_show_and_the_tracker_params_hide_it_the_job_file_keeps_it() -> None:
    spec = parse_spec(spec_with({"metrics": {"mlflow_experiment": "e",
                                             "mlflow_tracking_uri": "https://ann:s3cret@mlflow.site"}}))
    assert "s3cret" not in spec_to_toml(spec) and "https://ann:***@mlflow.site" in spec_to_toml(spec)
    assert spec_to_dict(spec)["metrics"]["mlflow_tracking_uri"] == "https://ann:***@mlflow.site"
    assert "s3cret" in spec_to_toml(spec, redact=False)  # spec.submit.toml, which the job reads (owner-only)
