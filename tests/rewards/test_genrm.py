"""GenRM: the judge prompt, verdict parsing, a fake engine with fixed replies, and the tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.memory import ScriptedEngine
from relax_hpc.rewards.genrm import GenRMJudge, parse_verdict, render_prompt
from relax_hpc.rewards.hub import RewardHub

TEMPLATE = "Q: {question}\nRef: {label}\nGot: {answer}\nJSON {\"ok\": 1}? Say 1 or 0."


class FakeTokenizer:
    chat_template = None
    eos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _sample(answer: str = "42") -> Sample:
    return Sample([1], [2], [-1.0], 0, group_id=0, prompt_index=0, label="42", prompt_text="6*7?",
                  response_text=answer)


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [("1", 1.0), ("0", 0.0), ("Verdict: 1.", 1.0), ("The answer is correct: 1\n0", 1.0),
     ("10 out of 10... 0", 0.0), ("score 0.5", None), ("yes", None), ("", None)],
)
def test_parse_verdict(reply: str, verdict: float | None) -> None:
    assert parse_verdict(reply) == verdict


def test_render_prompt_keeps_other_braces() -> None:
    assert render_prompt(TEMPLATE, _sample()) == 'Q: 6*7?\nRef: 42\nGot: 42\nJSON {"ok": 1}? Say 1 or 0.'


@pytest.mark.parametrize(("reply", "score", "unparsed"), [("1", 1.0, 0.0), (" 0", 0.0, 0.0), ("maybe", 0.0, 1.0)])
def test_fake_engine_judge(reply: str, score: float, unparsed: float) -> None:
    engine = ScriptedEngine(FakeTokenizer(), [reply])
    judge = GenRMJudge(engine, FakeTokenizer(), TEMPLATE)  # type: ignore[arg-type]
    assert judge.judge(_sample()) == {"score": score, "genrm_unparsed": unparsed}
    assert FakeTokenizer().decode(engine.calls[0][0][0]) == render_prompt(TEMPLATE, _sample())


def test_template_must_show_the_answer() -> None:
    with pytest.raises(ValueError, match=r"genrm_prompt must contain the \{answer\} placeholder"):
        GenRMJudge(ScriptedEngine(FakeTokenizer(), ["1"]), FakeTokenizer(), "Q: {question}")  # type: ignore[arg-type]


def test_genrm_through_the_hub() -> None:
    hub = RewardHub("genrm", genrm_prompt=TEMPLATE, genrm_engine=ScriptedEngine(FakeTokenizer(), ["1"]),  # type: ignore[arg-type]
                    genrm_tokenizer=FakeTokenizer(), concurrency=4)
    samples = [_sample(str(i)) for i in range(6)]
    metrics = hub.score(samples)
    hub.close()
    assert [s.reward for s in samples] == [1.0] * 6 and metrics["reward/count/genrm"] == 6.0


def test_tiny_model_as_judge(tiny_model_dir: Path) -> None:
    from relax_hpc.engines.native import NativeEngine

    engine = NativeEngine(str(tiny_model_dir))
    tokenizer: Any = engine.tokenizer
    judge = GenRMJudge(engine, tokenizer, "{question}={answer}? {label}")
    ids = judge.prompt_ids(_sample("7"))
    # The chat template wraps the rendered prompt as a user turn.
    assert tokenizer.decode(ids) == "<|im_start|>user:6*7?=7? 42<|im_end|><|im_start|>assistant:"
    outcome = judge.judge(_sample("7"))
    # An untrained model says anything; the judge must still turn it into a 0/1 score.
    assert outcome["score"] in (0.0, 1.0) and outcome["genrm_unparsed"] in (0.0, 1.0)
    if outcome["genrm_unparsed"]:
        assert outcome["score"] == 0.0
    deterministic = GenRMJudge(engine, tokenizer, "{question}={answer}", SamplingParams(max_new_tokens=4, temperature=1e-4))
    assert deterministic.judge(_sample()) == deterministic.judge(_sample())
