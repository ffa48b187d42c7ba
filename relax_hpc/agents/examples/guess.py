"""A multi-turn game: guess a secret digit 0-9 with "higher" / "lower" feedback.

Every prompt is "guess:" and the row's label is the secret. Each model turn is parsed as a
guess when it is a single digit; the environment answers "higher", "lower" or "guess a digit".
Per-turn rewards: 0.1 for a well-formed guess, and 1.0 more for the right one, which ends the
episode. A random policy forms a digit about one time in five and hits the secret about one
time in fifty per turn, so early steps carry signal; learning to guess digits, then to follow
the feedback, raises the reward. `python -m relax_hpc.agents.examples.guess OUT.jsonl` writes
the dataset (each secret a few times).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from relax_hpc.agents.env import BaseInteractionEnv, StepResult
from relax_hpc.data.sample import Sample

FORM_REWARD, WIN_REWARD = 0.1, 1.0


class GuessEnv(BaseInteractionEnv):
    def __init__(self, sample: Sample) -> None:
        super().__init__(sample)
        self.secret = int(sample.label)
        if not 0 <= self.secret <= 9:
            raise ValueError(f"GuessEnv: label must be a digit 0-9, got {sample.label!r}")

    def step(self, response_text: str) -> StepResult:
        text = response_text.strip()
        if len(text) != 1 or not text.isdigit():
            return StepResult("guess a digit", 0.0, info={"valid": False})
        guess = int(text)
        if guess == self.secret:
            return StepResult(None, FORM_REWARD + WIN_REWARD, terminated=True, info={"guess": guess})
        return StepResult("higher" if self.secret > guess else "lower", FORM_REWARD, info={"guess": guess})


def dataset_rows(copies: int = 2) -> list[dict[str, str]]:
    return [{"prompt": "guess:", "label": str(d)} for _ in range(copies) for d in range(10)]


if __name__ == "__main__":
    out = Path(sys.argv[1])
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in dataset_rows()))
    tmp.replace(out)
