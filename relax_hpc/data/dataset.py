"""Prompt datasets from JSON lines, with length filtering and a resumable, deterministic cursor.

A row holds a prompt (a string used as is, or a list of chat messages that goes through the
tokenizer's chat template) and a label the reward function compares against. Rows whose
prompt is longer than `max_prompt_tokens` are dropped, and the drops are counted with reasons.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PromptRow:
    index: int  # position in the filtered dataset
    prompt_ids: list[int]
    prompt_text: str
    label: Any
    metadata: dict[str, Any]


@dataclass
class LoadReport:
    rows_read: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def summary(self) -> str:
        drops = ", ".join(f"{n} {why}" for why, n in sorted(self.dropped.items())) or "none"
        return f"{self.kept} of {self.rows_read} rows kept (dropped: {drops})"


def _prompt_text(prompt: Any, tokenizer: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    raise ValueError("must be a string or a list of chat messages ({role, content} objects)")


def load_prompt_rows(
    path: str | Path, tokenizer: Any, prompt_key: str, label_key: str, max_prompt_tokens: int
) -> tuple[list[PromptRow], LoadReport]:
    """Read, tokenize and filter a jsonl dataset. Raises ValueError naming the line of a bad row."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist; check [data] path")
    rows: list[PromptRow] = []
    report = LoadReport()
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            report.rows_read += 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove the line") from e
            if not isinstance(record, dict) or prompt_key not in record:
                raise ValueError(
                    f"{path}:{lineno}: row has no '{prompt_key}' key; set [data] prompt_key to the "
                    f"field that holds the prompt (keys here: {sorted(record) if isinstance(record, dict) else '-'})"
                )
            try:
                text = _prompt_text(record[prompt_key], tokenizer)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: '{prompt_key}' {e}") from e
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if not ids:
                report.drop("empty prompt")
                continue
            if len(ids) > max_prompt_tokens:
                report.drop(f"longer than max_prompt_tokens={max_prompt_tokens}")
                continue
            meta = {k: v for k, v in record.items() if k not in (prompt_key, label_key)}
            rows.append(PromptRow(len(rows), ids, text, record.get(label_key), meta))
    report.kept = len(rows)
    if not rows:
        raise ValueError(f"dataset {path} has no usable rows: {report.summary()}")
    return rows, report


class DataCursor:
    """Walks a dataset in epochs, shuffled deterministically per epoch; its state is checkpointed.

    The state is (epoch, index, seed): the order of epoch e is a permutation drawn from
    Random(seed + e), so a restored cursor continues with exactly the rows it would have given.
    """

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        if size < 1:
            raise ValueError("a cursor needs a dataset with at least one row")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.index == self.size:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._order_for(self.epoch)
            out.append(self._order[self.index])
            self.index += 1
        return out

    def state(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "size": self.size}

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("size") != self.size or state.get("seed") != self.seed:
            raise ValueError(
                f"checkpointed data cursor {state} does not match this dataset (size {self.size}, "
                f"seed {self.seed}); the dataset or [job] seed changed since the checkpoint"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._order_for(self.epoch)
