"""The embedded task: addition of two digits from 0 to 4 ("3+4=" -> "7").

Why this task: a randomly initialised tiny policy answers it correctly only by chance (about
one sample in a hundred gets the digit and the end-of-turn token right), so the reward starts
small but non-zero; every prompt's answer depends on both operands, so the policy must really
learn the table rather than one fixed string; and a 2-layer model learns it with GRPO in a few
minutes on 2 CPU cores. The 25 pairs make 25 prompts; answers are single digits 0 to 8.

`relax-hpc make-tiny` does not need this module; `tools/make_tiny_data.py` writes the dataset.
"""

from __future__ import annotations

import json
from pathlib import Path


def tiny_sum_rows() -> list[dict[str, str]]:
    return [
        {"prompt": f"{a}+{b}=", "label": str(a + b)}
        for a in range(5)
        for b in range(5)
    ]


def write_tiny_sum_dataset(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in tiny_sum_rows()), encoding="utf-8")
    tmp.replace(path)
    return path
