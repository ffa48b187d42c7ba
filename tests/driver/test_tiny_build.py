"""`[model] build_tiny_if_missing`: a run writes the tiny model its spec names where [model] path
has none, and leaves a model that is there alone. In process, no Ray: `ensure_model` is what
`run_job` calls before anything loads the model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from relax_hpc.driver.run import ensure_model
from relax_hpc.models.tiny_tools import TOOL_CALL
from relax_hpc.spec import JobSpec, load_spec

REPO = Path(__file__).resolve().parents[2]


def _shipped(name: str, model_dir: Path) -> JobSpec:
    spec = load_spec(REPO / "jobspecs" / f"{name}.toml")
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, path=str(model_dir)))


@pytest.mark.parametrize("name", ["agent_tools_sdk", "agent_tools_langchain"])
def test_the_tool_specs_build_the_qwen3_with_the_one_token_lookup_call(tmp_path: Path, name: str) -> None:
    model_dir = tmp_path / "models" / "tiny-qwen3-tools"
    spec = _shipped(name, model_dir)
    assert (spec.model.build_tiny_if_missing, spec.model.tiny_arch) == (True, "qwen3_tools")
    ensure_model(spec)
    config = json.loads((model_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(model_dir)
    call = tok.encode(TOOL_CALL, add_special_tokens=False)
    assert len(call) == 1 and config["model_type"] == "qwen3"
    assert config["vocab_size"] == len(tok) and call[0] == len(tok) - 1  # the one token after the alphabet
    prompt = tok.apply_chat_template([{"role": "user", "content": "a?"}], tools=[{"type": "function", "function": {
        "name": "lookup", "parameters": {"type": "object", "properties": {}}}}], tokenize=False,
        add_generation_prompt=True)
    assert prompt == "<|im_start|>system:tools:lookup,<|im_end|><|im_start|>user:a?<|im_end|><|im_start|>assistant:"


def test_a_model_that_is_there_is_left_alone(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    ensure_model(_shipped("agent_tools_sdk", model_dir))
    written = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    ensure_model(_shipped("agent_tools_sdk", model_dir))  # write_tool_model would refuse an existing dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == written


def test_the_tool_model_ends_its_turn_after_the_call_and_is_random_elsewhere(tmp_path: Path) -> None:
    # seed 1 (relax_hpc/models/tiny_tools.py): P(end | call) 0.94, P(call first) 0.018, P(end first) 0.024
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    ensure_model(_shipped("agent_tools_sdk", model_dir))
    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    call, end = tok.encode(TOOL_CALL, add_special_tokens=False)[0], tok.eos_token_id
    ids = tok.encode("<|im_start|>user:what is in box a?<|im_end|><|im_start|>assistant:", add_special_tokens=False)
    with torch.no_grad():
        probs = model(torch.tensor([ids + [call]])).logits[0].softmax(-1)
    assert probs[-1, end] > 0.8  # a chat model's habit: the turn ends with the call
    assert probs[-2, call] < 0.05 and probs[-2, end] < 0.05  # the first token: about 1 in 49 each
