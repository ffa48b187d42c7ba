"""GenRM with a served judge: over HTTP from a real local engine server (a deterministic fake judge
that reads the rendered prompt), in process from the tiny model (genrm_model_path), and the spec's
checks on the judge keys."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import pytest
import torch

from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import Generation, SamplingParams
from relax_hpc.engines.http.auth import engine_token, write_token_file
from relax_hpc.engines.http.client import EngineAuthError, HttpEngine
from relax_hpc.engines.http.server import EngineServer
from relax_hpc.engines.native import NativeEngine
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.rewards.genrm import parse_verdict
from relax_hpc.rewards.hub import RewardHub
from relax_hpc.engines.fleet import build_genrm_judge
from relax_hpc.spec import RewardSpec, SpecError, parse_spec

# The tiny tokenizer is character level over digits, lower-case letters and "+-*=?:., ".
JUDGE_PROMPT = "ref: {label}, got: {answer}. same? say 1 or 0"
_FIELDS = re.compile(r"ref: (.*), got: (.*)\. same\?")
TINY_SPEC = (Path(__file__).resolve().parents[2] / "jobspecs" / "tiny_local.toml").read_text(encoding="utf-8")


class ComparingJudge:
    """A judge engine whose verdict is checkable: it decodes the prompt it is given and answers
    "1" when the candidate answer equals the reference, else "0" (and "maybe" without a match)."""

    weight_version = 0

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.prompts_seen = tokenizer, []

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[Generation]:
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            self.prompts_seen.append(text)
            found = _FIELDS.search(text)
            reply = "maybe" if found is None else "1" if found.group(1) == found.group(2) else "0"
            reply_ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"]
            out.append(Generation(ids, reply_ids, [-0.5] * len(reply_ids), "stop", 0, text=reply))
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise AssertionError("a judge is frozen")


def _sample(answer: str, label: str | None, index: int) -> Sample:
    return Sample([1], [2], [-1.0], 0, group_id=index, prompt_index=index, label=label, prompt_text="what is 6*7?",
                  response_text=answer)


@pytest.fixture(scope="module")
def judge_server(tiny_model_dir: Path) -> Iterator[tuple[EngineServer, ComparingJudge]]:
    judge = ComparingJudge(load_tokenizer(tiny_model_dir))
    # The job's own engine token: what a judge started with this job's RELAX_HPC_SECRET_FILE serves.
    with EngineServer(judge, token=engine_token(), model_info={"model_path": "comparing-judge"}) as server:
        yield server, judge


def test_genrm_over_http_scores_through_the_hub(
    judge_server: tuple[EngineServer, ComparingJudge], tiny_model_dir: Path
) -> None:
    server, judge = judge_server
    spec = RewardSpec(function="genrm", genrm_prompt=JUDGE_PROMPT, genrm_url=server.url,
                      genrm_tokenizer_path=str(tiny_model_dir), concurrency=4, timeout_s=30.0)
    engine, tokenizer = build_genrm_judge(spec, "float32", "cpu")
    assert isinstance(engine, HttpEngine) and engine.base_url == server.url
    hub = RewardHub.from_settings(spec, genrm_engine=engine, genrm_tokenizer=tokenizer)
    samples = [_sample("42", "42", 0), _sample("41", "42", 1), _sample("7", "7", 2), _sample("", "42", 3)]
    try:
        metrics = hub.score(samples)
    finally:
        hub.close()
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert all("reward_error" not in s.reward_info for s in samples), [s.reward_info for s in samples]
    assert metrics["reward/count/genrm"] == 4.0
    # The judge saw the spec's prompt inside the tokenizer's chat template.
    assert "<|im_start|>user:ref: 42, got: 41. same? say 1 or 0<|im_end|><|im_start|>assistant:" in judge.prompts_seen


def test_a_judge_with_its_own_token_is_reached_through_genrm_token_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    judge = ComparingJudge(load_tokenizer(tiny_model_dir))
    own_token = "j" * 64  # a judge started by hand: `relax-hpc serve-engine` made it a token of its own
    with EngineServer(judge, token=own_token) as server:
        settings = {"function": "genrm", "genrm_prompt": JUDGE_PROMPT, "genrm_url": server.url,
                    "genrm_tokenizer_path": str(tiny_model_dir), "timeout_s": 30.0}
        token_file = write_token_file(tmp_path / "judge.token", own_token)
        engine, _ = build_genrm_judge(RewardSpec(**settings, genrm_token_file=str(token_file)), "float32", "cpu")
        assert engine is not None and isinstance(engine, HttpEngine)
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))  # accepted
        # Without the file rollout sends the job's token, which this judge refuses, saying so.
        job_token_engine, _ = build_genrm_judge(RewardSpec(**settings), "float32", "cpu")
        assert job_token_engine is not None
        with pytest.raises(EngineAuthError):
            job_token_engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        token_file.chmod(0o644)
        with pytest.raises(ValueError, match="others could read the token; `chmod 600` it"):
            build_genrm_judge(RewardSpec(**settings, genrm_token_file=str(token_file)), "float32", "cpu")


def test_genrm_token_file_without_a_url_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"reward\.genrm_token_file.*only used with reward\.genrm_url"):
        parse_spec('[model]\npath = "m"\n[reward]\nfunction = "genrm"\ngenrm_prompt = "{answer}"\n'
                   'genrm_model_path = "/j"\ngenrm_token_file = "/t"\n')


def test_unparsable_judge_reply_over_http_scores_0_and_is_counted(
    judge_server: tuple[EngineServer, ComparingJudge], tiny_model_dir: Path
) -> None:
    server, _ = judge_server
    # A prompt the fake cannot read: it answers "maybe".
    hub = RewardHub("genrm", genrm_prompt="answer: {answer}", genrm_engine=HttpEngine(server.url, token=engine_token()),
                    genrm_tokenizer=load_tokenizer(tiny_model_dir))
    samples = [_sample("42", "42", 0)]
    try:
        hub.score(samples)
    finally:
        hub.close()
    assert samples[0].reward == 0.0 and samples[0].reward_info["genrm_unparsed"] == 1.0


def test_genrm_in_process_from_genrm_model_path(tiny_model_dir: Path) -> None:
    spec = RewardSpec(function="genrm", genrm_model_path=str(tiny_model_dir), timeout_s=60.0)
    engine, tokenizer = build_genrm_judge(spec, "float32", "cpu")
    assert isinstance(engine, NativeEngine)
    hub = RewardHub.from_settings(spec, genrm_engine=engine, genrm_tokenizer=tokenizer)
    samples = [_sample("42", "42", 0), _sample("5", "9", 1)]
    try:
        hub.score(samples)
        judge = hub.build("genrm")
    finally:
        hub.close()
    for sample in samples:
        assert "reward_error" not in sample.reward_info and "reward_timeout" not in sample.reward_info
        # The untrained tiny model replies noise; whatever it emits, the score is its parsed verdict.
        reply = engine.generate([judge.prompt_ids(sample)], judge.sampling)[0].text  # type: ignore[attr-defined]
        verdict = parse_verdict(reply)
        assert sample.reward in (0.0, 1.0)
        assert sample.reward == (verdict or 0.0)
        assert sample.reward_info["genrm_unparsed"] == float(verdict is None)


def test_url_judge_needs_a_tokenizer_path() -> None:
    spec = RewardSpec(function="genrm", genrm_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="genrm_url = 'http://127.0.0.1:1' needs genrm_tokenizer_path"):
        build_genrm_judge(spec, "float32", "cpu")
    assert build_genrm_judge(RewardSpec(function="math"), "float32", "cpu") == (None, None)


def _spec_with_reward(reward_lines: str) -> str:
    head, tail = TINY_SPEC.split('[reward]\nfunction = "tiny_sum"\n')
    return f"{head}[reward]\n{reward_lines}\n{tail}"


@pytest.mark.parametrize(
    ("reward_lines", "key", "says"),
    [
        ('function = "genrm"', "reward.genrm_model_path", 'is required when reward.function = "genrm"'),
        ('function = "genrm"\ngenrm_url = "http://judge:30000"', "reward.genrm_tokenizer_path",
         "is required with reward.genrm_url"),
        ('function = "genrm"\ngenrm_url = "judge:30000"\ngenrm_tokenizer_path = "m"', "reward.genrm_url",
         "starting with http:// or https://"),
        ('function = "genrm"\ngenrm_url = "http://judge:30000"\ngenrm_model_path = "m"', "reward.genrm_url",
         "cannot be set together with reward.genrm_model_path"),
    ],
)
def test_spec_reports_a_genrm_without_a_usable_judge(reward_lines: str, key: str, says: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(_spec_with_reward(reward_lines))
    problems = [p for p in caught.value.problems if p.key.startswith("reward.")]
    assert len(problems) == 1 and problems[0].key == key and says in problems[0].message


@pytest.mark.parametrize(
    "reward_lines",
    ['function = "genrm"\ngenrm_model_path = "judge"',
     'function = "genrm"\ngenrm_url = "http://judge:30000"\ngenrm_tokenizer_path = "judge"'],
)
def test_spec_accepts_either_judge(reward_lines: str) -> None:
    spec = parse_spec(_spec_with_reward(reward_lines))
    assert spec.reward.function == "genrm"
