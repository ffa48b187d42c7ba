"""`ifbench`: IFEval instruction following, scored as lm-evaluation-harness's strict scorer does.

A row lists its instructions as `instruction_id_list` (e.g. ["punctuation:no_comma",
"length_constraints:number_words"]) with one `kwargs` dict per instruction, either in the
sample's metadata or in a dict label. The score is 1 when every instruction is followed
(IFEval's strict prompt-level accuracy) and 0 otherwise; `followed_frac` logs the share of
instructions followed. The 25 checks live in `ifeval_checks`. An unknown instruction id or a
missing kwarg raises (the reward pool scores it 0 and counts the error), so a dataset typo shows
up instead of silently passing.

`ifbench_reward` matches keywords as the reference does (a substring, any case);
`IfbenchReward(keyword_match="whole_word")` counts `keywords:existence` / `keywords:frequency`
keywords only as whole words. Both are picklable for worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.ifeval_checks import (
    INSTRUCTION_IDS,
    KEYWORD_MATCHES,
    KeywordMatch,
    check_instruction,
)

__all__ = ["INSTRUCTION_IDS", "IfbenchReward", "check_instruction", "ifbench_reward"]


def _instructions(sample: Sample) -> tuple[list[str], list[dict[str, Any]]]:
    source: dict[str, Any] = sample.label if isinstance(sample.label, dict) else sample.metadata
    ids = source.get("instruction_id_list")
    if not isinstance(ids, list) or not ids:
        raise ValueError(
            "ifbench reward: the row has no 'instruction_id_list' (in its metadata or a dict label); "
            "keep that column in [data] metadata_keys"
        )
    kwargs = source.get("kwargs") or [{} for _ in ids]
    if len(kwargs) != len(ids):
        raise ValueError(f"ifbench reward: {len(ids)} instruction ids but {len(kwargs)} kwargs entries")
    return [str(i) for i in ids], [dict(kw or {}) for kw in kwargs]


@dataclass(frozen=True)
class IfbenchReward:
    """The ifbench reward with a keyword matching mode; a module-level class so it pickles."""

    keyword_match: KeywordMatch = "reference"

    def __post_init__(self) -> None:
        if self.keyword_match not in KEYWORD_MATCHES:
            raise ValueError(
                f"ifbench reward: keyword_match={self.keyword_match!r}; allowed: {', '.join(KEYWORD_MATCHES)}"
            )

    def __call__(self, sample: Sample) -> dict[str, float]:
        ids, kwargs = _instructions(sample)
        followed = sum(
            check_instruction(i, sample.response_text, kw, keyword_match=self.keyword_match)
            for i, kw in zip(ids, kwargs)
        )
        return {"score": float(followed == len(ids)), "followed_frac": followed / len(ids)}


_REFERENCE = IfbenchReward()


def ifbench_reward(sample: Sample) -> dict[str, float]:
    """Score 1.0 iff every instruction of the row is followed; keywords matched as the reference."""
    return _REFERENCE(sample)
