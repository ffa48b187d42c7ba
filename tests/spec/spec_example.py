"""A small valid job spec and a helper that derives variants of it for the spec tests."""

from __future__ import annotations

import sys
from typing import Any

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# The smallest complete spec plus a few explicit keys; every test starts from it.
VALID_SPEC = """\
[job]
name = "unit-test"
seed = 7

[model]
path = "models/tiny"
build_tiny_if_missing = true

[data]
path = "data/prompts.jsonl"

[rollout]
prompts_per_step = 4
n_samples_per_prompt = 4
stop = ["</answer>"]

[reward]
function = "math"

[train]
steps = 3
lr = 1e-5
"""

# Marks a key (or table) that spec_with should delete.
REMOVE = object()


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        if value is REMOVE:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def spec_with(changes: dict[str, Any]) -> str:
    """VALID_SPEC with ``changes`` merged in, as TOML text (nested dicts merge, REMOVE deletes)."""
    return tomli_w.dumps(_merge(tomllib.loads(VALID_SPEC), changes))
