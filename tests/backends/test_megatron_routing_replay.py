"""Routing replay (R3) end to end on CPU: the native engine records the experts a tiny Qwen3-MoE
routed each token to, and the Megatron trainer, replaying them, agrees with the engine's
log-probs better than with free routing.

The engine samples in bfloat16 and the trainer recomputes in float32, so a few near-tied router
decisions flip between the two (the test checks that some do: without flips it would prove
nothing). The engine runs here (project venv, transformers 5); the trainer runs
tests/backends/megatron_replay_check.py with the Megatron env's python (transformers 4.57,
megatron-core 0.16.1). A float32 engine run is the control: there Megatron must reproduce the
engine's routing and log-probs with or without replay. About a minute on 2 cores:

    RELAX_TEST_MEGATRON=1 .venv/bin/python -m pytest tests/backends/test_megatron_routing_replay.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from side_env import MEGATRON, run_json_script

from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.native import NativeEngine
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.models.tiny_moe import TinyMoeSize, write_tiny_moe_model

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

CHECK_SCRIPT = Path(__file__).with_name("megatron_replay_check.py")
CHECK_TIMEOUT_S = 300  # ~15 s alone on 2 cores, several times that beside a busy CI
PROMPTS = ("1+2=", "7*8=", "<|im_start|>user:5+4=<|im_end|><|im_start|>assistant:", "hello world", "9-3=", "abc")
# Weights 5x HF's default std: the experts then move the logits enough that a flipped routing
# decision shows in the log-probs (at 0.02 the tiny model's outputs are almost uniform).
MOE_SIZE = TinyMoeSize(initializer_range=0.1)
FP32_TOL = 1e-5  # fp32 Megatron vs the fp32 HF engine on the same routing; observed 5e-7


@pytest.fixture(scope="module")
def megatron_python() -> Path:
    return MEGATRON.python_or_skip()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe_model(tmp_path_factory.mktemp("r3") / "tiny-moe", seed=0, size=MOE_SIZE)


def _engine_samples(model_dir: Path, dtype: str, out: Path) -> Path:
    engine = NativeEngine(model_dir, dtype=dtype, record_routing=True)
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=1.0), seed=0)
    samples = []
    for g in gens:
        assert g.routed_experts is not None and g.routed_experts.dtype == torch.uint8
        assert g.routed_experts.shape == (len(g.prompt_ids) + len(g.token_ids) - 1, 2, 2)
        samples.append({"tokens": g.prompt_ids + g.token_ids, "prompt_length": len(g.prompt_ids),
                        "logprobs": g.logprobs, "routes": g.routed_experts})
    torch.save(samples, out)
    return out


def _run_check(python: Path, model_dir: Path, engine_files: list[Path]) -> dict[str, Any]:
    engines = [arg for f in engine_files for arg in ("--engine", str(f))]
    return run_json_script(python, CHECK_SCRIPT, "--model", str(model_dir), *engines, timeout_s=CHECK_TIMEOUT_S)


def test_replayed_routing_agrees_with_the_engine_better_than_free_routing(
    megatron_python: Path, moe_dir: Path, tmp_path: Path
) -> None:
    fp32 = _engine_samples(moe_dir, "float32", tmp_path / "engine-fp32.pt")
    bf16 = _engine_samples(moe_dir, "bfloat16", tmp_path / "engine-bf16.pt")
    result = _run_check(megatron_python, moe_dir, [fp32, bf16])
    assert result["routers"] == 2
    control, mixed = result["runs"]

    # Same precision: Megatron loads the MoE exactly and routes as the engine did, replay or not.
    for mode in ("free", "replay"):
        assert control[mode]["route_mismatches"] == 0, control
        assert control[mode]["max_abs_diff"] < FP32_TOL, control

    free, replay = mixed["free"], mixed["replay"]
    assert free["routes_compared"] == replay["routes_compared"] > 0
    assert free["route_mismatches"] > 0, f"no routing decision flipped between bf16 and fp32: {mixed}"
    assert replay["route_mismatches"] == 0, f"replay did not reproduce the engine's experts: {mixed}"
    assert replay["mean_abs_diff"] < free["mean_abs_diff"], mixed
    assert replay["max_abs_diff"] < free["max_abs_diff"], mixed
