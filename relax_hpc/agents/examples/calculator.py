"""Tool use: the model must call a calculator, read its answer, and repeat it.

The question is an expression such as "3*2=" (dataset rows carry the value as the label). The
model's first turn must be a tool call: `c:EXPR` evaluates EXPR, and a bare `c` (or `c:`)
evaluates the question's own expression, so the shortest call is one token. The tool answers "=6" as a `tool` message and the
model must answer "6". Per-turn rewards (summed into the sample's reward):

- call turn: 0.3 for a call, 0.1 for a response that starts with "c" but is not a call;
  anything else ends the episode (the answer must come from the tool).
- answer turn: 0.7 for exactly the value, 0.35 for a response that starts with it.

A random policy starts "c" about once in 48 tries, so early steps already hold a few rewarded
samples; the call is the same for every prompt and is learnt first, then copying the tool's
answer. `python -m relax_hpc.agents.examples.calculator OUT.jsonl` writes the dataset.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from relax_hpc.agents.env import BaseInteractionEnv, StepResult
from relax_hpc.data.sample import Sample

CALL_REWARD, ANSWER_REWARD = 0.3, 0.7
_EXPR = re.compile(r"^\d{1,3}([+*-]\d{1,3}){0,3}$")


def evaluate(expr: str) -> str:
    """The value of a small +, -, * expression of integers (no eval), or "error"."""
    if not _EXPR.match(expr):
        return "error"
    total = 0
    for k, term in enumerate(re.split(r"(?=[+-])", expr)):
        if not term:
            continue
        sign = -1 if term[0] == "-" else 1
        product = 1
        for factor in term.lstrip("+-").split("*"):
            product *= int(factor)
        total += sign * product
    return str(total)


class CalculatorEnv(BaseInteractionEnv):
    observation_role = "tool"

    def __init__(self, sample: Sample) -> None:
        super().__init__(sample)
        self.expression = sample.prompt_text.rstrip("=")
        self.answer = str(sample.label)
        self.called = False

    def step(self, response_text: str) -> StepResult:
        text = response_text.strip()
        if not self.called:
            if text == "c" or text.startswith("c:"):
                self.called = True
                expr = text[2:] or self.expression
                return StepResult("=" + evaluate(expr), CALL_REWARD, info={"call": expr})
            partial = CALL_REWARD / 3 if text.startswith("c") else 0.0
            return StepResult(None, partial, terminated=True, info={"error": "no tool call"})
        if text == self.answer:
            return StepResult(None, ANSWER_REWARD, terminated=True)
        partial = ANSWER_REWARD / 2 if text.startswith(self.answer) else 0.0
        return StepResult(None, partial, terminated=True)


def dataset_rows() -> list[dict[str, str]]:
    """Products and sums of small numbers with single-digit results: 35 questions."""
    rows = [{"prompt": f"{a}*{b}=", "label": str(a * b)} for a in range(1, 4) for b in range(1, 4)]
    rows += [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(5) for b in range(5) if a + b <= 9]
    return rows + [{"prompt": "9-4=", "label": "5"}]


if __name__ == "__main__":
    out = Path(sys.argv[1])
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in dataset_rows()))
    tmp.replace(out)
