"""`ifbench`: verifiable instruction-following checks in the IFEval / IFBench row format.

A row lists its instructions as `instruction_id_list` (e.g. ["punctuation:no_comma",
"length_constraints:number_words"]) with one `kwargs` dict per instruction, either in the
sample's metadata or in a dict label. The score is 1 when every instruction is followed
(IFEval's strict prompt-level accuracy) and 0 otherwise; `followed_frac` logs the share of
instructions followed. An unknown instruction id raises (the reward pool scores it 0 and
counts the error) so a typo in a dataset shows up instead of silently passing.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from relax_hpc.data.sample import Sample

Check = Callable[[str, dict[str, Any]], bool]

_BULLET = re.compile(r"^\s*[*-]\s+\S", re.M)
_WORD = re.compile(r"\b\w+\b")


def _compare(count: int, relation: str, target: int) -> bool:
    if relation in ("less than", "less_than", "<"):
        return count < target
    if relation in ("at least", "at_least", ">="):
        return count >= target
    if relation in ("at most", "at_most", "<="):
        return count <= target
    if relation in ("exactly", "==", "equal"):
        return count == target
    raise ValueError(f"relation {relation!r} is not one of 'less than', 'at least', 'at most', 'exactly'")


def _json_format(text: str, kw: dict[str, Any]) -> bool:
    body = text.strip()
    for fence in ("```json", "```JSON", "```Json", "```"):
        body = body.removeprefix(fence)
    body = body.removesuffix("```").strip()
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def _sentences(text: str) -> int:
    return len([s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s])


CHECKS: dict[str, Check] = {
    "punctuation:no_comma": lambda t, kw: "," not in t,
    "change_case:english_lowercase": lambda t, kw: t == t.lower(),
    "change_case:english_capital": lambda t, kw: t == t.upper(),
    "detectable_format:json_format": _json_format,
    "detectable_format:number_bullet_lists": lambda t, kw: len(_BULLET.findall(t)) == int(kw["num_bullets"]),
    "detectable_format:title": lambda t, kw: re.search(r"<<[^\n]+>>", t) is not None,
    "length_constraints:number_words": lambda t, kw: _compare(
        len(_WORD.findall(t)), kw.get("relation", "at least"), int(kw["num_words"])
    ),
    "length_constraints:number_sentences": lambda t, kw: _compare(
        _sentences(t), kw.get("relation", "at least"), int(kw["num_sentences"])
    ),
    "length_constraints:number_paragraphs": lambda t, kw: len(
        [p for p in re.split(r"\s*\*\*\*\s*", t.strip()) if p.strip()]
    ) == int(kw["num_paragraphs"]),
    "keywords:existence": lambda t, kw: all(
        re.search(rf"\b{re.escape(k)}\b", t, re.I) for k in kw["keywords"]
    ),
    "keywords:forbidden_words": lambda t, kw: not any(
        re.search(rf"\b{re.escape(k)}\b", t, re.I) for k in kw["forbidden_words"]
    ),
    "keywords:frequency": lambda t, kw: _compare(
        len(re.findall(rf"\b{re.escape(kw['keyword'])}\b", t, re.I)), kw.get("relation", "at least"),
        int(kw["frequency"]),
    ),
    "startend:end_checker": lambda t, kw: t.strip().lower().endswith(str(kw["end_phrase"]).strip().lower()),
    "startend:quotation": lambda t, kw: len(t.strip()) > 1 and t.strip()[0] == t.strip()[-1] == '"',
    "detectable_content:postscript": lambda t, kw: re.search(
        rf"^\s*{re.escape(kw.get('postscript_marker', 'P.S.'))}", t, re.I | re.M
    ) is not None,
}


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
    # Parquet exports fill absent kwargs with None; IFEval's own files use {}.
    return [str(i) for i in ids], [{k: v for k, v in (kw or {}).items() if v is not None} for kw in kwargs]


def ifbench_reward(sample: Sample) -> dict[str, float]:
    ids, kwargs = _instructions(sample)
    followed = 0
    for instruction, kw in zip(ids, kwargs):
        check = CHECKS.get(instruction)
        if check is None:
            raise ValueError(
                f"ifbench reward: unknown instruction id {instruction!r}; supported: {', '.join(sorted(CHECKS))}"
            )
        followed += bool(check(sample.response_text, kw))
    return {"score": float(followed == len(ids)), "followed_frac": followed / len(ids)}
