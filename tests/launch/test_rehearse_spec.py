"""`relax-hpc rehearse`'s pure part: each shipped production spec -> its rehearsal spec and changes
table (golden files), what a rehearsal keeps, and the synthetic rows its rewards read.

Re-record the golden tables after an intended change of the mapping:

    RELAX_RECORD_GOLDEN=1 .venv/bin/pytest tests/launch/test_rehearse_spec.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.launch.rehearse_build import write_synthetic_rows
from relax_hpc.launch.rehearse_spec import Machine, Rehearsal, format_changes, rehearsal_spec
from relax_hpc.rewards.registry import resolve_reward
from relax_hpc.spec import JobSpec, load_spec, parse_spec, spec_to_toml

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
PRODUCTION = ("qwen3_omni", "qwen3_vl_4b_openr1", "qwen3_4b_dapo")
# Fixed stand-ins for what rehearse.py finds on the machine, so the tables do not depend on it.
SGLANG_PYTHON, MEGATRON_PYTHON = "/envs/sglang/bin/python", "/envs/megatron/bin/python"


def _spec(name: str) -> JobSpec:
    return load_spec(REPO / "jobspecs" / f"{name}.toml")


def _rehearse(spec: JobSpec, device: str = "cpu", **machine: object) -> Rehearsal:
    facts = {"sglang_python": SGLANG_PYTHON, "megatron_python": MEGATRON_PYTHON} | machine
    work = Path(f"/rehearse/{spec.job.name}")
    return rehearsal_spec(spec, Machine(device, 3, work, **facts))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", PRODUCTION)
def test_changes_table_matches_golden(name: str) -> None:
    golden = GOLDEN / f"rehearse_{name}.txt"
    text = format_changes(_rehearse(_spec(name)).changes) + "\n"
    if os.environ.get("RELAX_RECORD_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.is_file(), f"{golden} missing: record it with RELAX_RECORD_GOLDEN=1"
    assert text == golden.read_text(), (
        f"the rehearsal of {name} changes other keys than {golden} records; if intended, re-record with "
        "RELAX_RECORD_GOLDEN=1 and review the diff")


@pytest.mark.parametrize("name", PRODUCTION)
def test_rehearsal_keeps_the_layout_and_loads_back(name: str) -> None:
    spec = _spec(name)
    rehearsal = _rehearse(spec)
    r = rehearsal.spec
    parse_spec(spec_to_toml(r), "rehearsal")  # a valid spec, as rehearse.py writes it
    kept = lambda s: (s.job.mode, s.cluster.colocate, s.train.strategy, s.train.backend, s.rollout.engine,  # noqa: E731
                      dataclasses.replace(s.algorithm, overlong_buffer_len=0), s.reward, s.data.prompt_key, s.data.label_key, s.data.image_key,
                      s.data.audio_key, s.rollout.dynamic_sampling, s.train.micro_batch_size,
                      s.train.mini_batches, s.model.dtype, s.train.lr)
    assert kept(r) == kept(spec)
    # DAPO's overlong buffer keeps its share of the rehearsal's shorter responses
    share = spec.algorithm.overlong_buffer_len / spec.rollout.max_new_tokens
    assert r.algorithm.overlong_buffer_len == (0 if share == 0 else max(1, round(share * r.rollout.max_new_tokens)))
    assert r.train.device == "cpu" and r.train.steps == 3
    assert r.train.num_processes == 2 and r.rollout.num_engines == 2  # >= 2: sharding, a router
    assert r.rollout.n_samples_per_prompt == 2
    rows = r.rollout.prompts_per_step * r.rollout.n_samples_per_prompt
    assert rows % r.train.mini_batches == 0 and rows >= r.train.num_processes * r.train.mini_batches
    assert r.rollout.sglang.python == SGLANG_PYTHON
    assert Path(r.model.path) == Path(f"/rehearse/{spec.job.name}/model")
    assert rehearsal.arch == spec.model.arch
    assert {c.key for c in rehearsal.changes} >= {"model.path", "data.path", "train.steps", "[cluster.*]"}


def test_megatron_runs_from_its_environment_at_a_smaller_data_parallel_size() -> None:
    spec = _spec("qwen3_4b_dapo")
    rehearsal = _rehearse(spec)
    assert rehearsal.runner == MEGATRON_PYTHON
    # TP 2 kept, so the data-parallel 2 of the 4 GPUs goes: 2 ranks, the weights cut as in production
    assert rehearsal.spec.train.megatron == spec.train.megatron and spec.train.megatron.tensor_parallel == 2
    assert rehearsal.spec.train.num_processes == 2
    wide = dataclasses.replace(spec, train=dataclasses.replace(
        spec.train, num_processes=16, megatron=dataclasses.replace(spec.train.megatron, tensor_parallel=4,
                                                                   pipeline_parallel=2, expert_parallel=2)))
    m = _rehearse(wide).spec.train
    # TP 4 -> 2 and PP 2 kept; data parallel 16 / 8 = 2 stays 2 for EP 2 (its ranks are data-parallel ones)
    assert (m.megatron.tensor_parallel, m.megatron.pipeline_parallel, m.megatron.expert_parallel) == (2, 2, 2)
    assert m.num_processes == 8
    assert _rehearse(spec, megatron_python=None).runner is None  # this interpreter has megatron


def test_cuda_keeps_every_size_and_changes_only_model_data_and_steps() -> None:
    spec = _spec("qwen3_omni")
    rehearsal = _rehearse(spec, "cuda")
    r = rehearsal.spec
    assert (r.train.device, r.train.num_processes, r.rollout.num_engines, r.rollout.sglang.tp_size) == ("cuda", 8, 4, 2)
    assert (r.rollout.prompts_per_step, r.rollout.max_new_tokens, r.data.video_key) == (32, 4096, "video")
    assert [c.key for c in rehearsal.changes] == [
        "job.output_dir", "model.path", "data.path", "train.steps", "rollout.sglang.python",
        "health.max_global_restarts", "[cluster.*]", "container.image"]


def test_sglang_on_cpu_leaves_video_out_and_the_synthetic_rows_follow() -> None:
    rehearsal = _rehearse(_spec("qwen3_omni"))
    assert rehearsal.spec.data.video_key is None and rehearsal.spec.rollout.sglang.tp_size == 1
    assert rehearsal.synthetic_kinds == ("audio",)
    native = _spec("qwen3_omni")
    native = dataclasses.replace(native, rollout=dataclasses.replace(native.rollout, engine="native"))
    assert _rehearse(native).synthetic_kinds == ("audio", "video")


def test_the_architecture_comes_from_arch_then_config_then_the_spec() -> None:
    spec = _spec("qwen3_vl_4b_openr1")
    assert _rehearse(spec).arch == "qwen3_vl"
    config = {"model_type": "qwen3_omni_moe", "thinker_config": {"text_config": {"num_hidden_layers": 48,
                                                                                "hidden_size": 2048}}}
    readable = _rehearse(spec, model_config=config)
    assert readable.arch == "qwen3_omni"
    assert "48 layers, 2048 hidden" in readable.changes[1].production
    assert _rehearse(spec, model_config=config, arch="qwen2_5_vl").arch == "qwen2_5_vl"
    with pytest.raises(ValueError, match="model_type 'llama'.*--arch"):
        _rehearse(spec, model_config={"model_type": "llama"})
    unknown = dataclasses.replace(spec, model=dataclasses.replace(spec.model, arch=None))
    with pytest.raises(ValueError, match=r"set arch .* in \[model\], or pass --arch"):
        _rehearse(unknown)


def test_readable_data_is_kept() -> None:
    spec = _spec("qwen3_4b_dapo")
    rehearsal = _rehearse(spec, data_readable=True)
    assert rehearsal.synthetic_kinds is None and rehearsal.spec.data.path == spec.data.path
    assert "data.path" not in {c.key for c in rehearsal.changes}


@pytest.mark.parametrize("name", PRODUCTION)
def test_synthetic_labels_are_what_the_specs_reward_parses(name: str, tmp_path: Path) -> None:
    rehearsal = _rehearse(_spec(name))
    d, reward = rehearsal.spec.data, rehearsal.spec.reward.function
    path = write_synthetic_rows(d, reward, rehearsal.synthetic_kinds or (), tmp_path / "train.jsonl", rows=4, seed=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    score = resolve_reward(reward)
    for row in rows:
        label = row
        for part in d.label_key.split("."):
            label = label[part]
        for kind in rehearsal.synthetic_kinds or ():
            key = {"image": d.image_key, "audio": d.audio_key, "video": d.video_key}[kind]
            assert (tmp_path / row[str(key)]).is_file()
        inner = str(label).replace("<answer>", "").replace("</answer>", "").strip()
        right = {"multiple_choice": f"Answer: {inner.upper()}", "openr1mm": f"<answer>{inner}</answer>",
                 "dapo": f"Answer: {inner}"}[reward]
        sample = Sample([], [], [], 0, 0, 0, label=label, response_text=right, metadata=row)
        assert score(sample)["score"] == 1.0, (row, right)
        sample.response_text = "Answer: 0"  # wrong: no synthetic answer is 0 or a letter 0
        assert score(sample)["score"] < 1.0


def test_cuda_gives_the_tiny_model_the_positions_the_spec_needs(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from relax_hpc.launch.rehearse_build import give_positions, write_tiny_model_of

    assert _rehearse(_spec("qwen3_vl_4b_openr1")).positions is None  # CPU: the budgets shrink to fit
    cuda = _rehearse(_spec("qwen3_vl_4b_openr1"), "cuda")
    assert cuda.positions == 2048 + 4096
    model = write_tiny_model_of("qwen3_vl", tmp_path / "vl", seed=1, on_sglang=True)
    give_positions(model, cuda.positions)
    config = AutoConfig.from_pretrained(model)
    assert config.text_config.max_position_embeddings == 2048 + 4096
    assert config.vision_config.num_position_embeddings == 64  # the vision tower's learned table stays
    assert json.loads((model / "tokenizer_config.json").read_text())["model_max_length"] == 2048 + 4096


def test_a_rehearsal_logs_to_no_tracker() -> None:
    spec = _spec("qwen3_4b_dapo")
    tracked = dataclasses.replace(spec, metrics=dataclasses.replace(
        spec.metrics, wandb_project="p", clearml_project="p", mlflow_experiment="e"))
    rehearsal = _rehearse(tracked)
    m = rehearsal.spec.metrics
    assert (m.wandb_project, m.clearml_project, m.mlflow_experiment) == (None, None, None)
    assert {"metrics.wandb_project", "metrics.clearml_project", "metrics.mlflow_experiment"} <= {
        c.key for c in rehearsal.changes}
