"""Every class of spec problem: what is reported, with which key, value, message and line."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from spec_example import REMOVE, VALID_SPEC, spec_with

from relax_hpc.spec import SpecError, SpecProblem, load_spec, parse_spec


def problems_of(text: str, source: str = "x.toml") -> list[SpecProblem]:
    with pytest.raises(SpecError) as caught:
        parse_spec(text, source)
    return caught.value.problems


def only_problem(changes: dict[str, Any]) -> SpecProblem:
    problems = problems_of(spec_with(changes))
    assert len(problems) == 1, [p.format("x.toml") for p in problems]
    return problems[0]


def test_the_example_is_valid() -> None:
    assert parse_spec(VALID_SPEC).job.name == "unit-test"


# --- unknown keys ---------------------------------------------------------------------


def test_unknown_key_suggests_the_close_name() -> None:
    problem = only_problem({"rollout": {"topp": 0.9}})
    assert problem.key == "rollout.topp"
    assert problem.value == "0.9"
    assert 'did you mean "top_p"?' in problem.message
    assert problem.allowed is not None and '"top_p"' in problem.allowed


def test_unknown_key_in_a_nested_table_suggests_the_close_name() -> None:
    problem = only_problem({"cluster": {"trainer": {"gpu_per_node": 2}}})
    assert problem.key == "cluster.trainer.gpu_per_node"
    assert 'did you mean "gpus_per_node"?' in problem.message


def test_unknown_table_suggests_the_close_name() -> None:
    problem = only_problem({"rolout": {"top_p": 0.9}})
    assert problem.key == "rolout"
    assert problem.message.startswith("unknown table")
    assert 'did you mean "rollout"?' in problem.message


def test_key_in_the_wrong_table_names_its_table() -> None:
    problem = only_problem({"save_interval": 5})
    assert problem.key == "save_interval"
    assert "belongs in [checkpoint]" in problem.message


# --- wrong types ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "key", "message"),
    [
        ({"train": {"steps": "3"}}, "train.steps", "expected an integer, got a string"),
        ({"train": {"steps": 3.0}}, "train.steps", "expected an integer, got a float"),
        ({"train": {"steps": True}}, "train.steps", "expected an integer, got a boolean"),
        ({"data": {"shuffle": 1}}, "data.shuffle", "expected a boolean, got an integer"),
        ({"rollout": {"temperature": "hot"}}, "rollout.temperature", "expected a number, got a string"),
        ({"rollout": {"top_p": False}}, "rollout.top_p", "expected a number, got a boolean"),
        ({"model": {"path": 3}}, "model.path", "expected a string, got an integer"),
        ({"rollout": {"stop": "</s>"}}, "rollout.stop", "expected an array, got a string"),
        ({"rollout": {"stop": ["a", 3]}}, "rollout.stop[1]", "expected a string, got an integer"),
        ({"cluster": {"trainer": 2}}, "cluster.trainer", "expected a table, got an integer"),
    ],
)
def test_wrong_type_names_expected_and_actual(changes: dict[str, Any], key: str, message: str) -> None:
    problem = only_problem(changes)
    assert (problem.key, problem.message) == (key, message)


def test_int_for_bool_lists_true_and_false() -> None:
    problem = only_problem({"metrics": {"plot": 0}})
    assert problem.value == "0"
    assert problem.allowed == "true, false"


def test_int_is_accepted_for_float_and_becomes_float() -> None:
    spec = parse_spec(spec_with({"train": {"lr": 1, "grad_clip": 0}}))
    assert spec.train.lr == 1.0 and isinstance(spec.train.lr, float)
    assert spec.train.grad_clip == 0.0 and isinstance(spec.train.grad_clip, float)


# --- bad values -----------------------------------------------------------------------

FINITE = "must be a finite number (not inf or nan, and within about ±1.8e308)"


@pytest.mark.parametrize(
    ("changes", "key", "message"),
    [
        ({"rollout": {"top_p": 1.5}}, "rollout.top_p", "must be in (0, 1]"),
        ({"rollout": {"top_p": 0}}, "rollout.top_p", "must be in (0, 1]"),
        ({"rollout": {"temperature": 0.0}}, "rollout.temperature", "must be > 0"),
        ({"rollout": {"temperature": float("nan")}}, "rollout.temperature", FINITE),
        ({"job": {"seed": -1}}, "job.seed", "must be in [0, 4294967295]"),
        ({"train": {"steps": 0}}, "train.steps", "must be in [1, 10000000]"),
        ({"train": {"lr": 0}}, "train.lr", "must be > 0"),
        ({"train": {"adam_betas": [0.9]}}, "train.adam_betas", "must hold exactly 2 values, got 1"),
        ({"train": {"adam_betas": [0.9, 1.0]}}, "train.adam_betas", "element 1 (1.0) must be in [0, 1)"),
        ({"algorithm": {"kl_coef": -0.1}}, "algorithm.kl_coef", "must be >= 0"),
    ],
)
def test_out_of_range_says_the_range(changes: dict[str, Any], key: str, message: str) -> None:
    problem = only_problem(changes)
    assert (problem.key, problem.message) == (key, message)


def test_literal_lists_the_allowed_values() -> None:
    problem = only_problem({"algorithm": {"name": "ppo"}})
    assert problem.key == "algorithm.name"
    assert problem.value == "'ppo'"
    assert problem.message == "is not one of the allowed values"
    assert problem.allowed == '"grpo", "dr_grpo", "gspo", "sapo", "opd"'
    assert problem.format("x.toml").endswith('allowed: "grpo", "dr_grpo", "gspo", "sapo", "opd"')


@pytest.mark.parametrize("name", ["has space", "", "a" * 65, "..", "slash/name"])
def test_bad_job_name(name: str) -> None:
    problem = only_problem({"job": {"name": name}})
    assert problem.key == "job.name"
    assert "1..64 characters" in problem.message


@pytest.mark.parametrize("function", ["math", "my_rewards.math:score", "pkg.sub.mod:f"])
def test_reward_function_forms_accepted(function: str) -> None:
    assert parse_spec(spec_with({"reward": {"function": function}})).reward.function == function


@pytest.mark.parametrize("function", ["pkg.mod", "pkg.mod:", ":f", "pkg..mod:f", "a-b:f", "pkg.mod:f:g"])
def test_reward_function_forms_rejected(function: str) -> None:
    problem = only_problem({"reward": {"function": function}})
    assert problem.key == "reward.function"
    assert '"package.module:function"' in problem.message


@pytest.mark.parametrize(
    ("memory", "ok"), [("64G", True), ("512000M", True), ("4096", True), ("64GB", False), ("1.5G", False)]
)
def test_cluster_memory_format(memory: str, ok: bool) -> None:
    text = spec_with({"cluster": {"rollout": {"memory": memory}}})
    if ok:
        assert parse_spec(text).cluster.rollout.memory == memory
    else:
        problem = only_problem({"cluster": {"rollout": {"memory": memory}}})
        assert problem.key == "cluster.rollout.memory"
        assert "Slurm memory size" in problem.message


@pytest.mark.parametrize("time", ["1:60:00", "0", "1-24", "2h", "1-2:3:4:5"])
def test_cluster_time_format_rejected(time: str) -> None:
    problem = only_problem({"cluster": {"trainer": {"time": time}}})
    assert problem.key == "cluster.trainer.time"
    assert "is not a Slurm time limit" in problem.message
    assert "D-H:M:S" in problem.message


# --- missing required keys ------------------------------------------------------------


def test_missing_job_name() -> None:
    problem = only_problem({"job": {"name": REMOVE}})
    assert problem.key == "job.name"
    assert problem.value is None
    assert problem.message == "required key is missing; set it under [job]"


def test_missing_train_table_reports_train_steps() -> None:
    problem = only_problem({"train": REMOVE})
    assert problem.key == "train.steps"
    assert "required key is missing" in problem.message
    assert problem.format("x.toml") == "x.toml: train.steps: required key is missing; set it under [train]"


def test_empty_file_reports_every_required_key() -> None:
    keys = sorted(p.key for p in problems_of(""))
    assert keys == ["data.path", "job.name", "model.path", "reward.function", "train.steps"]


# --- cross-field checks ---------------------------------------------------------------


def test_colocate_requires_zero_staleness() -> None:
    problem = only_problem({"algorithm": {"max_staleness": 2}})
    assert problem.key == "algorithm.max_staleness"
    assert 'job.mode = "colocate"' in problem.message
    assert 'set max_staleness = 0 or use mode = "async"' in problem.message


def test_async_allows_staleness() -> None:
    spec = parse_spec(spec_with({"job": {"mode": "async"}, "algorithm": {"max_staleness": 2}}))
    assert spec.algorithm.max_staleness == 2


def test_samples_per_step_must_split_into_mini_batches() -> None:
    problem = only_problem({"train": {"mini_batches": 3}})  # 4 prompts * 4 samples = 16
    assert problem.key == "train.mini_batches"
    assert "rollout.prompts_per_step * rollout.n_samples_per_prompt = 4 * 4 = 16" in problem.message
    assert problem.allowed == "1, 2, 4, 8, 16"


def test_group_algorithms_need_two_samples() -> None:
    problem = only_problem({"rollout": {"n_samples_per_prompt": 1}})
    assert problem.key == "rollout.n_samples_per_prompt"
    assert 'must be >= 2 with algorithm.name = "grpo"' in problem.message


def test_cross_check_is_silent_when_its_input_is_already_wrong() -> None:
    # max_staleness is wrong by itself; the colocate check must not report it a second time.
    problem = only_problem({"algorithm": {"max_staleness": -1}})
    assert problem.message == "must be in [0, 10000000]"


def test_forward_component_without_kl_is_allowed() -> None:
    spec = parse_spec(spec_with({"cluster": {"forward": {"nodes": 1}}}))
    assert spec.cluster.forward is not None and spec.algorithm.kl_coef == 0.0


# --- impossible resources -------------------------------------------------------------


def test_trainer_processes_must_fit_on_trainer_gpus() -> None:
    problem = only_problem({"train": {"num_processes": 5}, "cluster": {"trainer": {"nodes": 2, "gpus_per_node": 2}}})
    assert problem.key == "train.num_processes"
    assert "cluster.trainer.nodes * cluster.trainer.gpus_per_node = 2 * 2 = 4" in problem.message


def test_trainer_processes_fit_exactly() -> None:
    changes = {"train": {"num_processes": 4}, "cluster": {"trainer": {"nodes": 2, "gpus_per_node": 2}}}
    assert parse_spec(spec_with(changes)).train.num_processes == 4


def test_cpu_trainer_processes_are_not_limited_by_gpus() -> None:
    assert parse_spec(spec_with({"train": {"num_processes": 4}})).train.num_processes == 4


def test_rollout_engines_must_fit_on_rollout_gpus() -> None:
    problem = only_problem({"rollout": {"num_engines": 3}, "cluster": {"rollout": {"gpus_per_node": 2}}})
    assert problem.key == "rollout.num_engines"
    assert "cluster.rollout.nodes * cluster.rollout.gpus_per_node = 1 * 2 = 2" in problem.message


def test_colocated_engines_must_fit_on_trainer_gpus() -> None:
    # Engines then share the trainer's 1 * 2 GPUs; cluster.rollout (4 GPUs) is not used.
    changes = {"rollout": {"num_engines": 3}, "cluster": {"colocate": True, "trainer": {"gpus_per_node": 2},
                                                          "rollout": {"gpus_per_node": 4}}}
    problem = only_problem(changes)
    assert problem.key == "rollout.num_engines"
    assert "cluster.trainer.nodes * cluster.trainer.gpus_per_node = 1 * 2 = 2" in problem.message
    assert "cluster.colocate = true" in problem.message and "[cluster.trainer]" in problem.message
    fits = {"rollout": {"num_engines": 2}, "cluster": {"colocate": True, "trainer": {"gpus_per_node": 2}}}
    assert parse_spec(spec_with(fits)).rollout.num_engines == 2


def test_colocated_cluster_needs_colocate_mode() -> None:
    problem = only_problem({"job": {"mode": "async"}, "cluster": {"colocate": True}})
    assert problem.key == "cluster.colocate" and problem.value == "true"
    assert 'needs job.mode = "colocate", not "async"' in problem.message
    assert 'set mode = "colocate" in [job] or colocate = false' in problem.message
    assert parse_spec(spec_with({"cluster": {"colocate": True}})).cluster.colocate


def test_cuda_device_needs_trainer_gpus() -> None:
    problem = only_problem({"train": {"device": "cuda"}})
    assert problem.key == "train.device"
    assert "cluster.trainer.gpus_per_node = 0" in problem.message
    ok = parse_spec(spec_with({"train": {"device": "cuda"}, "cluster": {"trainer": {"gpus_per_node": 1}}}))
    assert ok.train.device == "cuda"


def test_sglang_engines_of_several_gpus_must_fit_whole_on_nodes() -> None:
    # 2 nodes * 4 GPUs with 3-GPU engines: one engine per node, not 8 // 3 = 2.
    cluster = {"rollout": {"nodes": 2, "gpus_per_node": 4}}
    problem = only_problem({"rollout": {"engine": "sglang", "num_engines": 3, "sglang": {"tp_size": 3}},
                            "cluster": cluster})
    assert problem.key == "rollout.num_engines" and problem.value == "3"
    assert "must be <= 2" in problem.message and "rollout.sglang.tp_size = 3" in problem.message
    fits = {"rollout": {"engine": "sglang", "num_engines": 4, "sglang": {"tp_size": 2}}, "cluster": cluster}
    assert parse_spec(spec_with(fits)).rollout.sglang.tp_size == 2


def test_sglang_engine_larger_than_a_node_is_refused() -> None:
    problem = only_problem({"rollout": {"engine": "sglang", "sglang": {"tp_size": 8}},
                            "cluster": {"rollout": {"nodes": 2, "gpus_per_node": 4}}})
    assert problem.key == "rollout.sglang.tp_size"
    assert "cluster.rollout.gpus_per_node = 4" in problem.message and "share a node" in problem.message


MEGATRON = {"backend": "megatron", "num_processes": 8}


def test_megatron_model_parallel_sizes_must_divide_the_processes() -> None:
    problem = only_problem({"train": {**MEGATRON, "num_processes": 6,
                                      "megatron": {"tensor_parallel": 2, "pipeline_parallel": 2}}})
    assert problem.key == "train.num_processes" and problem.value == "6"
    assert "tensor_parallel * pipeline_parallel * context_parallel = 2 * 2 * 1 = 4" in problem.message
    ok = parse_spec(spec_with({"train": {**MEGATRON, "megatron": {"tensor_parallel": 2, "pipeline_parallel": 2}}}))
    assert ok.train.megatron.pipeline_parallel == 2


def test_megatron_expert_parallel_comes_from_data_parallel_ranks() -> None:
    problem = only_problem({"train": {**MEGATRON, "megatron": {"tensor_parallel": 2, "expert_parallel": 3}}})
    assert problem.key == "train.megatron.expert_parallel"
    assert "train.num_processes / (tensor_parallel * pipeline_parallel) = 4" in problem.message


def test_megatron_tensor_parallel_stays_in_a_node() -> None:
    problem = only_problem({"train": {**MEGATRON, "megatron": {"tensor_parallel": 8}},
                            "cluster": {"trainer": {"nodes": 2, "gpus_per_node": 4}}})
    assert problem.key == "train.megatron.tensor_parallel"
    assert "cluster.trainer.gpus_per_node = 4" in problem.message and "pipeline_parallel" in problem.message


def test_megatron_keys_with_the_torch_backend_are_refused() -> None:
    problems = problems_of(spec_with({"train": {"megatron": {"tensor_parallel": 2}},
                                      "algorithm": {"routing_replay": True}}))
    assert sorted(p.key for p in problems) == ["algorithm.routing_replay", "train.megatron.tensor_parallel"]
    assert all('backend = "megatron"' in p.message for p in problems)


@pytest.mark.parametrize("megatron", [{"recompute": "full"}, {"context_parallel": 2}])
def test_routing_replay_refuses_full_recompute_and_context_parallel(megatron: dict[str, Any]) -> None:
    problems = problems_of(spec_with({"train": {**MEGATRON, "megatron": megatron},
                                      "algorithm": {"routing_replay": True}}))
    (problem,) = [p for p in problems if p.key == "algorithm.routing_replay"]
    assert "cannot be combined with train.megatron." in problem.message
    # context_parallel > 1 is refused on its own as well (test_run_refusals.py).
    assert {p.key for p in problems} - {"algorithm.routing_replay"} <= {"train.megatron.context_parallel"}
    ok = parse_spec(spec_with({"train": {**MEGATRON, "megatron": {"recompute": "selective"}},
                               "algorithm": {"routing_replay": True}}))
    assert ok.algorithm.routing_replay


def test_sequence_parallel_needs_tensor_parallel() -> None:
    problem = only_problem({"train": {**MEGATRON, "megatron": {"sequence_parallel": True}}})
    assert problem.key == "train.megatron.sequence_parallel" and "tensor_parallel > 1" in problem.message


def test_distributed_optimizer_needs_cuda() -> None:
    problem = only_problem({"train": {**MEGATRON, "device": "cpu", "megatron": {"distributed_optimizer": True}}})
    assert problem.key == "train.megatron.distributed_optimizer" and "needs CUDA" in problem.message


@pytest.mark.parametrize("component", ["trainer", "rollout", "forward"])
def test_more_than_16_gpus_per_node_is_rejected(component: str) -> None:
    problem = only_problem({"cluster": {component: {"gpus_per_node": 17}}})
    assert problem.key == f"cluster.{component}.gpus_per_node"
    assert problem.message == "no Slurm node has more than 16 GPUs; check the value"


# --- malformed TOML, files, the report ------------------------------------------------


def test_malformed_toml_is_one_problem_with_its_line() -> None:
    text = '[job]\nname = "x"\n\n[train]\nsteps = = 3\n'
    (problem,) = problems_of(text)
    assert problem.line == 5
    assert problem.message.startswith("invalid TOML: ")
    assert "(column" in problem.message
    assert problem.format("x.toml").startswith("x.toml:5: invalid TOML: ")


def test_duplicate_table_is_malformed() -> None:
    (problem,) = problems_of(VALID_SPEC + "\n[job]\nseed = 1\n")
    assert problem.message.startswith("invalid TOML: ")
    assert problem.line == VALID_SPEC.count("\n") + 2


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(SpecError) as caught:
        load_spec(missing)
    assert str(missing) in str(caught.value)
    assert "no such file" in str(caught.value)


def test_directory_and_binary_files_are_reported(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)
    binary = tmp_path / "spec.toml"
    binary.write_bytes(b"\xff\xfe[job]\n")
    with pytest.raises(SpecError, match="not UTF-8"):
        load_spec(binary)


def test_all_problems_are_reported_at_once_in_file_order() -> None:
    text = """\
[job]
name = "ok"
mode = "sync"

[model]
path = "m"

[data]
path = "d"
shufle = false

[rollout]
top_p = 1.5

[reward]
function = "math"

[train]
steps = "many"
"""
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "jobspecs/x.toml")
    report = str(caught.value).splitlines()
    assert report[0] == "invalid job spec jobspecs/x.toml (4 problems):"
    assert report[1].startswith("jobspecs/x.toml:3: job.mode = 'sync': is not one of the allowed values; allowed: ")
    assert report[2].startswith("jobspecs/x.toml:10: data.shufle = False: unknown key (did you mean \"shuffle\"?)")
    assert report[3] == "jobspecs/x.toml:13: rollout.top_p = 1.5: must be in (0, 1]"
    assert report[4] == "jobspecs/x.toml:19: train.steps = 'many': expected an integer, got a string"
    assert "docs/spec.md" in report[5]


def test_line_numbers_follow_dotted_keys_and_inline_tables() -> None:
    text = VALID_SPEC + '\n[cluster]\ntrainer.nodes = 0\nrollout = { nodes = 1, qos = 3 }\n'
    problems = {p.key: p.line for p in problems_of(text)}
    first_cluster_line = VALID_SPEC.count("\n") + 2
    assert problems == {"cluster.trainer.nodes": first_cluster_line + 1, "cluster.rollout.qos": first_cluster_line + 2}


def test_spec_error_survives_pickling() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec("", "a.toml")
    copy = pickle.loads(pickle.dumps(caught.value))
    assert isinstance(copy, SpecError)
    assert copy.problems == caught.value.problems
    assert str(copy) == str(caught.value)


def test_opd_without_a_teacher_is_reported() -> None:
    from relax_hpc.spec import SpecError, parse_spec

    text = (
        '[job]\nname = "x"\n[model]\npath = "m"\n[data]\npath = "d.jsonl"\n'
        '[algorithm]\nname = "opd"\n[reward]\nfunction = "tiny_sum"\n[train]\nsteps = 1\n'
    )
    try:
        parse_spec(text)
    except SpecError as e:
        assert [p.key for p in e.problems] == ["algorithm.opd_teacher_path"]
        assert "teacher" in str(e)
    else:
        raise AssertionError("opd without opd_teacher_path must be rejected")
