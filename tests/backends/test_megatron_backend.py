"""The Megatron backend on CPU against the real libraries: HF log-probs, the torch backend's
gradients, resharding checkpoints, and the tiny task end to end.

Each test runs tests/backends/megatron_backend_check.py (or `relax-hpc run`) with the python of
tools/setup-megatron-cpu's environment, in gloo processes as trainer ranks run. Without that
environment they skip, unless RELAX_TEST_MEGATRON=1 (then test_megatron_cpu.py's
test_the_megatron_environment_is_built fails). 2-3.5 minutes on 2 cores, a third of it the
end-to-end run:

    RELAX_TEST_MEGATRON=1 .venv/bin/python -m pytest tests/backends/test_megatron_backend.py -q
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from side_env import MEGATRON, REPO, run_json_script, side_process_env

CHECK_SCRIPT = Path(__file__).with_name("megatron_backend_check.py")
TIMEOUT_S = 600  # each run is ~10-30 s alone on 2 cores; far longer beside a busy CI
# fp32 on the same weights: observed ~5e-7 (log-probs) and ~2.4e-7 (gradients up to 0.6).
LOGPROB_TOL = 1e-5
GRAD_TOL = 1e-5

pytestmark = [pytest.mark.slow, pytest.mark.megatron]


@pytest.fixture(scope="module")
def megatron_python() -> Path:
    return MEGATRON.python_or_skip()


def _check(python: Path, *args: str) -> dict[str, Any]:
    return run_json_script(python, CHECK_SCRIPT, *args, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def reshard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reshard")


@pytest.fixture(scope="module")
def tp2_launch(megatron_python: Path, tiny_model_dir: Path, reshard_dir: Path) -> dict[str, Any]:
    """Two TP=2 ranks run the match scenario, then the reshard chain's first link (a step, saved
    as step 1), then the match scenario again as two pipeline stages, then the bfloat16 scenario
    at TP=2 (one launch for all four: each rank's imports cost about 10 s on 2 cores)."""
    ckpt = reshard_dir / "checkpoints"
    result = _check(megatron_python, "match,save,match@pp2,bf16", "--model", str(tiny_model_dir), "--ranks", "2",
                    "--tp", "2", "--ckpt", str(ckpt), "--out", str(reshard_dir / "tp2-saved.pt"))
    return {**result, "listing": sorted(p.name for p in ckpt.iterdir())}


@pytest.fixture(scope="module")
def tp1_launch(megatron_python: Path, tiny_model_dir: Path, reshard_dir: Path, tp2_launch: dict[str, Any],
               tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One TP=1 rank runs the chain's second link (resume step 1, train, save step 2), then the
    routing-replay scenario on a tiny MoE."""
    import dataclasses

    from relax_hpc.models.tiny_moe import TinyMoeSize, write_tiny_moe_model

    moe = write_tiny_moe_model(tmp_path_factory.mktemp("moe") / "tiny-moe", seed=0,
                               size=dataclasses.replace(TinyMoeSize(), initializer_range=0.1))
    ckpt = reshard_dir / "checkpoints"
    result = _check(megatron_python, "resume,replay", "--model", str(tiny_model_dir), "--moe-model", str(moe),
                    "--ranks", "1", "--tp", "1", "--ckpt", str(ckpt), "--out", str(reshard_dir / "tp1-resumed.pt"),
                    "--save-next")
    return {**result, "listing": sorted(p.name for p in ckpt.iterdir())}


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_log_probs_equal_hf_and_gradients_equal_the_torch_backends(layout: str, request: pytest.FixtureRequest) -> None:
    launch = request.getfixturevalue("tp2_launch")  # its ranks run both layouts
    result = launch["match"] if layout == "tp2" else launch["match@pp2"]
    assert result["reads_rows"] is True  # rank 0 reads; its peer gets the rows from it
    assert result["tokens"] == 11
    assert result["logprob_max_abs_diff"] < LOGPROB_TOL, result
    # Every HF parameter has a gradient on both sides, and they agree.
    assert result["grad_names"] == 24 and result["grad_missing"] == result["grad_extra"] == []
    assert result["grad_max_abs"] > 0.1  # a gradient worth comparing
    assert result["grad_max_abs_diff"] < GRAD_TOL, result
    ours, theirs = result["stats"], result["torch_stats"]
    assert sorted(ours) == sorted(theirs)  # the same metric names
    for key in theirs:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    assert abs(ours["loss/policy"]) > 1e-3  # a loss worth comparing


def test_bf16_model_steps_float32_masters_at_lr_1e6_and_checkpoints_them(tp2_launch: dict[str, Any]) -> None:
    # bf16 parameters (compute) with float32 masters that AdamW steps, as megatron-core's
    # Float16OptimizerWithFloat16Params keeps them. At lr 1e-6 Adam's first step moves each weight
    # by about 1e-6, far below the bf16 spacing of the tiny model's weights (2^-7 of their size,
    # ~1e-4 for a weight of 0.02): the masters change, their bf16 rounding (the parameters, what
    # AdamW stepping bf16 parameters directly would leave) almost never does.
    result = tp2_launch["bf16"]
    assert result["param_dtypes"] == ["torch.bfloat16"] and result["master_dtypes"] == ["torch.float32"]
    assert result["stats"]["grad_norm"] > 0 and abs(result["stats"]["loss/policy"]) > 1e-3
    assert result["masters_changed"] > 0.9, result
    assert result["params_changed"] < 0.05, result
    assert 5e-7 < result["master_max_step"] < 1e-5, result  # a step of about lr, not a bf16 rounding step
    assert result["params_are_rounded_masters"] is True
    # The checkpoint holds the masters, not their bf16 rounding: a resumed backend has them exactly.
    assert result["resumed_step"] == 1
    assert result["resumed_masters_max_diff"] == 0.0 and result["resumed_params_equal"] is True
    assert result["resumed_moments_equal"] is True
    assert result["export_names"] == 24 and result["export_dtypes"] == ["torch.bfloat16"]


def test_bf16_rank_memory_record_counts_its_shard_masters_moments_and_gradient_buffer(
        tp2_launch: dict[str, Any]) -> None:
    # Rank 0 of TP = 2, bf16: 2 bytes per parameter element it holds, a float32 master (4) and two
    # float32 moments (8) per element plus AdamW's 4-byte step per tensor, a float32 gradient
    # buffer (grad_reduce_in_fp32) of at least 4 per element; and the whole model's bytes counted
    # over both ranks (2 per element of the HF model), of which this rank holds about half.
    memory = tp2_launch["bf16"]["memory"]
    on_device, local, tensors = memory["record"]["on_device"], memory["local_elements"], memory["local_tensors"]
    assert memory["record"]["model_bytes"] == 2 * memory["model_elements"], memory
    assert 2 * local <= on_device["parameters"] <= 2.2 * local, memory
    assert on_device["masters"] == 4 * local, memory
    assert 8 * local <= on_device["optimizer"] <= 8 * local + 8 * tensors, memory
    assert on_device["gradients"] >= 4 * local, memory
    assert on_device["parameters"] < 0.75 * memory["record"]["model_bytes"], memory  # a TP shard, not the model


def test_routing_replay_through_the_backend_agrees_better_with_the_engine(tp1_launch: dict[str, Any]) -> None:
    # The whole R3 path: a bfloat16 native engine records its routing, the rows carry it through
    # the queue's row format, and the float32 MegatronBackend (built with routing replay) replays
    # it in compute_log_probs and in a training step. TP=1: megatron-core refuses MoE with TP > 1
    # unless sequence parallelism is on, which cannot be built on CPU (docs/backends.md).
    result = tp1_launch["replay"]
    assert result["tokens"] > 40
    assert result["replay_mean"] < result["free_mean"], result
    assert result["replay_max"] < result["free_max"], result
    assert result["stats"]["grad_norm"] > 0 and result["stats"]["ratio_mean"] == pytest.approx(1.0, abs=0.05)
    # Without Transformer Engine the bridge cannot name one-module-per-expert weights: a clear refusal.
    assert "grouped-GEMM layout" in result["export"] and 'backend = "torch"' in result["export"], result["export"]


@pytest.fixture(scope="module")
def reshard_chain(megatron_python: Path, tiny_model_dir: Path, reshard_dir: Path, tp2_launch: dict[str, Any],
                  tp1_launch: dict[str, Any]) -> dict[str, Any]:
    """Three launches check both reshard directions: TP=2 saves step 1 (`tp2_launch`); TP=1
    resumes it, takes the next step and saves it as step 2 (`tp1_launch`); TP=2 resumes step 2
    (here). Each resume is compared with what the run before it held and did next."""
    ckpt = reshard_dir / "checkpoints"
    out = {name: reshard_dir / f"{name}.pt" for name in ("tp2-saved", "tp1-resumed", "tp2-resumed")}
    tp2 = _check(megatron_python, "resume", "--model", str(tiny_model_dir), "--ranks", "2", "--tp", "2",
                 "--ckpt", str(ckpt), "--out", str(out["tp2-resumed"]))
    loaded = {name: torch.load(path, weights_only=False) for name, path in out.items()}
    return {
        "tp2-to-tp1": {"listing": tp2_launch["listing"], "resumed_step": tp1_launch["resume"]["resumed_step"],
                       "ckpt": ckpt / "step_1", "saved": loaded["tp2-saved"], "resumed": loaded["tp1-resumed"]},
        "tp1-to-tp2": {"listing": tp1_launch["listing"], "resumed_step": tp2["resumed_step"], "ckpt": ckpt / "step_2",
                       "saved": loaded["tp1-resumed"]["next"], "resumed": loaded["tp2-resumed"]},
    }


@pytest.mark.parametrize(("direction", "listing", "step"), [
    ("tp2-to-tp1", ["latest", "step_1"], 1), ("tp1-to-tp2", ["latest", "step_1", "step_2"], 2)],
    ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_a_checkpoint_reshards_with_identical_weights_moments_and_next_step(
    reshard_chain: dict[str, Any], direction: str, listing: list[str], step: int
) -> None:
    link = reshard_chain[direction]
    assert link["listing"] == listing
    assert (link["ckpt"] / ".metadata").is_file() and (link["ckpt"] / "resume.json").is_file()
    assert link["resumed_step"] == step
    a, b = link["saved"], link["resumed"]
    for kind in ("weights", "exp_avg", "exp_avg_sq"):  # each with HF names, whole tensors
        assert sorted(a["tensors"][kind]) == sorted(b["tensors"][kind]), kind
        for name, tensor in a["tensors"][kind].items():
            assert torch.equal(tensor, b["tensors"][kind][name]), (kind, name)
    assert any(t.abs().max() > 0 for t in a["tensors"]["exp_avg"].values())  # a trained moment
    # The step after the resume equals the step the saving run took next.
    for key, value in a["stats"].items():
        assert b["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_tiny_megatron_jobspec_trains_with_reward_rising(megatron_python: Path, tmp_path: Path) -> None:
    relax = megatron_python.parent / "relax-hpc"
    assert relax.is_file(), f"{relax} is missing: tools/setup-megatron-cpu installs relax-hpc there"
    text = (REPO / "jobspecs" / "tiny_megatron.toml").read_text()
    # The jobspec itself; only where it writes moves out of the checkout.
    text = text.replace('name = "tiny_megatron"\n', f'name = "tiny_megatron"\noutput_dir = "{tmp_path / "job"}"\n', 1)
    text = text.replace('"runs/models/tiny-qwen3"', f'"{tmp_path / "model"}"', 1)
    spec = tmp_path / "tiny_megatron.toml"
    spec.write_text(text)
    done = subprocess.run([str(relax), "run", str(spec), "--no-progress"], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=1800,
                          env=side_process_env(RAY_AUTH_MODE="disabled"))
    assert done.returncode == 0, f"relax-hpc run exited {done.returncode}:\n{done.stderr[-6000:]}"
    rows = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, 61))
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    # As for the torch backend (tests/driver/test_train_e2e.py): ~1-2% right at random.
    assert first < 0.05
    assert last > 3 * first and last > 0.08, (first, last)
    assert re.search(r"finished step 60 \(from 0\)", done.stdout + done.stderr), done.stdout[-2000:]
    assert sorted(p.name for p in (tmp_path / "job" / "checkpoints").iterdir()) == [
        "latest", "step_50", "step_60"]


# `relax-hpc convert` of a Megatron checkpoint, through megatron-bridge: the reshard chain's
# step 2 (saved at TP = 1 after resuming TP = 2's step 1) is converted by the Megatron
# environment's `relax-hpc convert`, and this venv's transformers loads it. The weights must be
# those the backend held when it saved step 2, as the bridge exported them live. (Its own launch
# until 2026-12-03: a TP = 1 rank that trained one step and saved it, 25-85 s, now shared.)
@pytest.fixture(scope="module")
def converted(megatron_python: Path, tiny_model_dir: Path, reshard_dir: Path,
              tp1_launch: dict[str, Any]) -> dict[str, Any]:
    spec = (REPO / "jobspecs" / "tiny_megatron.toml").read_text()
    (reshard_dir / "spec.toml").write_text(spec.replace('"runs/models/tiny-qwen3"', f'"{tiny_model_dir}"', 1))
    out = reshard_dir / "hf"
    done = subprocess.run([str(megatron_python.parent / "relax-hpc"), "convert", str(reshard_dir), str(out)],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=side_process_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, f"relax-hpc convert exited {done.returncode}:\n{done.stdout}\n{done.stderr[-6000:]}"
    assert done.stdout.strip().splitlines()[-1] == f"wrote {out}"
    saved = torch.load(reshard_dir / "tp1-resumed.pt", weights_only=False)["next"]["tensors"]["weights"]
    return {"hf": out, "trained": saved, "checkpoint": reshard_dir / "checkpoints" / "step_2"}


def test_convert_writes_the_weights_the_megatron_backend_trained(converted: dict[str, Any],
                                                                 tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(converted["hf"], local_files_only=True).state_dict()
    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).state_dict()
    trained: dict[str, torch.Tensor] = converted["trained"]
    assert len(trained) == 24 and set(trained) <= set(exported)  # every HF tensor the bridge names
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor), name
        assert not torch.equal(source[name], tensor), name  # the steps moved it
    tokenizer = AutoTokenizer.from_pretrained(converted["hf"])
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()


def test_without_megatron_the_export_names_the_environment_that_converts(
    converted: dict[str, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    import importlib.util

    from relax_hpc.ckpt.export import export_hf
    from relax_hpc.ckpt.formats import checkpoint_backend
    from relax_hpc.launch.convert import export_checkpoint

    checkpoint = converted["checkpoint"]
    assert checkpoint_backend(checkpoint) == "megatron"
    with pytest.raises(ValueError, match=r"written by the megatron backend.*relax-hpc convert"):
        export_hf(checkpoint, tiny_model_dir, tmp_path / "out")
    if importlib.util.find_spec("megatron") is not None:
        return  # a venv with megatron converts it; the project's has none (the bridge needs transformers < 5)
    with pytest.raises(ValueError, match=r"needs megatron-core and megatron-bridge.*tools/setup-megatron-cpu"):
        export_checkpoint(checkpoint, tiny_model_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
