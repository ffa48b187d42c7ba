"""A rehearsal of a tool-calling spec (`[model] tiny_arch = "qwen3_tools"`) builds the tiny qwen3
with the tool format, whether the spec's model is built yet or not: the plain tiny qwen3 has no
token for the `lookup` call its agents learn."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from relax_hpc.launch.rehearse_build import write_tiny_model_of
from relax_hpc.launch.rehearse_spec import Machine, rehearsal_spec
from relax_hpc.models.tiny_tools import TOOL_CALL
from relax_hpc.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


def test_the_rehearsal_of_a_tool_spec_writes_the_tool_model(tmp_path: Path) -> None:
    spec = load_spec(REPO / "jobspecs" / "agent_tools_sdk.toml")
    work = tmp_path / "rehearse"
    unbuilt = rehearsal_spec(spec, Machine("cpu", 2, work))
    built = rehearsal_spec(spec, Machine("cpu", 2, work, model_config={"model_type": "qwen3"}))
    assert unbuilt.arch == built.arch == "qwen3_tools"
    model = write_tiny_model_of(built.arch, Path(built.spec.model.path), seed=1, on_sglang=built.spec.rollout.on_sglang)
    assert len(AutoTokenizer.from_pretrained(model).encode(TOOL_CALL, add_special_tokens=False)) == 1
    plain = rehearsal_spec(load_spec(REPO / "jobspecs" / "agent_calculator.toml"),
                           Machine("cpu", 2, work, model_config={"model_type": "qwen3"}))
    assert plain.arch == "qwen3"  # a qwen3 spec that builds no tool model keeps the plain one
