"""A valid spec resolved: defaults, the job directory, dict/TOML rendering and line lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spec_example import VALID_SPEC, spec_with

from relax_hpc.spec import (
    ALGORITHMS,
    ComponentSpec,
    JobSpec,
    SpecError,
    load_spec,
    parse_spec,
    spec_to_dict,
    spec_to_toml,
)
from relax_hpc.spec.lines import LineIndex


def test_defaults_are_applied() -> None:
    spec = parse_spec(VALID_SPEC)
    assert spec.job.seed == 7  # set explicitly
    assert (spec.job.mode, spec.job.output_dir) == ("colocate", None)
    assert (spec.model.dtype, spec.model.build_tiny_if_missing) == ("float32", True)
    assert (spec.data.prompt_key, spec.data.label_key, spec.data.shuffle, spec.data.max_prompt_tokens) == (
        "prompt",
        "label",
        True,
        512,
    )
    assert (spec.rollout.engine, spec.rollout.max_new_tokens, spec.rollout.top_k, spec.rollout.top_p) == (
        "native",
        64,
        0,
        1.0,
    )
    assert spec.rollout.stop == ["</answer>"]
    assert spec.algorithm.name == "grpo" and spec.algorithm.kl_estimator == "low_var_kl"
    assert spec.algorithm.loss_agg == "seq_mean_token_mean" and spec.algorithm.normalize_std is True
    train = spec.train
    assert (train.backend, train.lr, train.adam_betas, train.device) == ("torch", 1e-5, [0.9, 0.999], "auto")
    assert (spec.checkpoint.save_interval, spec.checkpoint.keep_last, spec.checkpoint.resume) == (50, 2, True)
    assert spec.metrics.wandb_project is None and spec.metrics.tensorboard is True
    assert spec.cluster.trainer == ComponentSpec() and spec.cluster.rollout == ComponentSpec()
    assert spec.cluster.forward is None
    assert (ComponentSpec().nodes, ComponentSpec().cpus_per_node, ComponentSpec().time) == (1, 2, "01:00:00")


def test_absent_sub_table_keeps_defaults_of_its_siblings() -> None:
    spec = parse_spec(spec_with({"cluster": {"rollout": {"gpus_per_node": 4, "extra_sbatch": ["--exclusive"]}}}))
    assert spec.cluster.trainer == ComponentSpec()
    assert spec.cluster.rollout.gpus_per_node == 4 and spec.cluster.rollout.nodes == 1
    assert spec.cluster.rollout.extra_sbatch == ["--exclusive"]


def test_default_lists_are_not_shared_between_specs() -> None:
    first, second = parse_spec(VALID_SPEC), parse_spec(VALID_SPEC)
    assert first.train.adam_betas is not second.train.adam_betas


def test_algorithms_constant_matches_allowed_names() -> None:
    assert ALGORITHMS == ("grpo", "dr_grpo", "gspo", "sapo", "opd")
    for name in ALGORITHMS:
        teacher = {"opd_teacher_path": "/models/teacher"} if name == "opd" else {}
        assert parse_spec(spec_with({"algorithm": {"name": name, **teacher}})).algorithm.name == name


def test_job_dir_defaults_to_runs_name_under_the_cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    spec = parse_spec(VALID_SPEC)
    assert spec.job_dir() == tmp_path / "runs" / "unit-test"
    assert spec.job_dir(base=Path("/shared")) == Path("/shared/runs/unit-test")


def test_job_dir_uses_output_dir(tmp_path: Path) -> None:
    relative = parse_spec(spec_with({"job": {"output_dir": "out/here"}}))
    assert relative.job_dir(base=tmp_path) == tmp_path / "out" / "here"
    absolute = parse_spec(spec_with({"job": {"output_dir": "/scratch/jobs/a"}}))
    assert absolute.job_dir(base=tmp_path) == Path("/scratch/jobs/a")


def test_spec_to_dict_is_plain_and_complete() -> None:
    data = spec_to_dict(parse_spec(VALID_SPEC))
    json.dumps(data)  # only plain types
    assert data["rollout"]["top_p"] == 1.0
    assert data["cluster"]["forward"] is None
    assert data["cluster"]["trainer"]["time"] == "01:00:00"
    tables = {"job", "model", "data", "rollout", "algorithm", "reward", "train", "critic", "checkpoint", "metrics", "notify",
              "federation", "health", "security", "cluster", "container"}
    assert set(data) == tables


@pytest.mark.parametrize(
    "text",
    [
        VALID_SPEC,
        spec_with(
            {
                "job": {"mode": "async", "output_dir": "/tmp/x"},
                "algorithm": {"name": "opd", "max_staleness": 1, "kl_coef": 0.01,
                              "opd_teacher_path": "/models/teacher"},
                "metrics": {"wandb_project": "p"},
                "train": {"lr": 3e-7, "adam_betas": [0.8, 0.95]},
                "cluster": {
                    "trainer": {"gpus_per_node": 8, "memory": "512000M", "partition": "gpu", "account": "a"},
                    "rollout": {"qos": "q", "nodes": 2},
                    "forward": {"constraint": "h100", "time": "2-00:00:00", "extra_sbatch": ["--exclusive"]},
                },
            }
        ),
    ],
)
def test_spec_to_toml_round_trips(text: str) -> None:
    spec = parse_spec(text)
    rendered = spec_to_toml(spec)
    assert parse_spec(rendered) == spec
    assert "[cluster.trainer]" in rendered


def test_load_spec_reads_a_file_and_reports_its_path(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(VALID_SPEC, encoding="utf-8")
    assert isinstance(load_spec(path), JobSpec)
    assert load_spec(str(path)) == parse_spec(VALID_SPEC)
    path.write_text(VALID_SPEC.replace("steps = 3", "steps = 0"), encoding="utf-8")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    line = VALID_SPEC.splitlines().index("steps = 3") + 1
    assert f"{path}:{line}: train.steps = 0: must be in [1, 10000000]" in str(caught.value)


def test_line_index() -> None:
    text = """\
# comment = 1
top = 1
[job]
name = "a"   # name = "b"
"quoted.key" = 2
description = \"\"\"
seed = 3
\"\"\"
[cluster.trainer]
nodes = 2
[cluster]
rollout.nodes = 3
forward = { nodes = 1 }
"""
    index = LineIndex(text)
    assert index.line_of("top") == 2
    assert index.line_of("job") == 3
    assert index.line_of("job.name") == 4
    assert index.line_of("job.quoted.key") is None  # a quoted key is one part, not two
    assert index.line_of("job.seed") is None  # inside a multi-line string
    assert index.line_of("cluster.trainer.nodes") == 10
    assert index.line_of("cluster.rollout.nodes") == 12
    assert index.line_of("cluster.forward.nodes") == 13  # inline table: the line of its key
    assert index.line_of("job.missing") is None
    assert index.line_of("cluster.trainer.extra_sbatch[2]") is None
    assert index.line_of("job.name[0]") == 4
