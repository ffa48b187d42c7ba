"""An agent session that exports several samples (agent_export_style = "individual", one per
completion) fits the transfer queue with a full step, in a real in-process run: the queue holds
prompts_per_step x n_samples_per_prompt x max_turns rows a step, and a session that exports more
than max_turns samples fails the step naming the key to raise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_doubles import ScriptedEngine, tiny_tokenizer
from relax_hpc.agents.service import AgenticRollout
from relax_hpc.data.dataset import PromptRow
from relax_hpc.driver.run import run_job
from relax_hpc.engines.base import SamplingParams
from relax_hpc.spec import parse_spec
from relax_hpc.spec.schema import RolloutSpec

REPO = Path(__file__).resolve().parents[2]


def agent_spec(tmp_path: Path, max_turns: int) -> str:
    return f"""
[job]
name = "agent-queue"
output_dir = "{tmp_path / 'job'}"
seed = 1

[model]
path = "{tmp_path / 'tiny'}"
build_tiny_if_missing = true

[data]
path = "{REPO / 'jobspecs' / 'data' / 'tiny_sum.jsonl'}"
max_prompt_tokens = 16

[rollout]
prompts_per_step = 2
n_samples_per_prompt = 2
max_new_tokens = 2
agent = "agent_doubles:ChatAgent"   # two completions a session
agent_export_style = "individual"
max_turns = {max_turns}

[reward]
function = "relax_hpc.agents.rewards:env_reward"

[train]
steps = 2
lr = 1e-3

[checkpoint]
save_interval = 100

[metrics]
tensorboard = false
plot = false
"""


def test_a_step_of_two_samples_per_session_fits_the_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # 2 prompts x 2 sessions x 2 completions = 8 rows a step, twice prompts x samples (4)
    run_job(parse_spec(agent_spec(tmp_path, max_turns=2)), in_process=True, progress=False)
    lines = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["rollout/completions_per_session"], m["samples/step"]) for m in lines] == [(2.0, 8.0)] * 2


def test_a_session_that_exports_more_than_max_turns_names_the_key() -> None:
    # Checked where the sessions end, before the step's rows go to a queue sized for max_turns each.
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, ["ab", "cd"])
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(int(tok.eos_token_id),))
    svc = AgenticRollout(RolloutSpec(agent="agent_doubles:ChatAgent", max_turns=1), engine, tok, params,
                         int(tok.eos_token_id), 256)
    try:
        with pytest.raises(RuntimeError, match=r'exported 2 samples \(agent_export_style = "individual"\), more '
                           r"than \[rollout\] max_turns = 1.*set \[rollout\] max_turns to at least 2"):
            svc.generate_groups([PromptRow(0, [], "hi", "x", {})], 2, seed=1, first_group_id=1)
    finally:
        svc.close()
