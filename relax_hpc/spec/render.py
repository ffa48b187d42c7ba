"""Turn a JobSpec back into plain data: a dict (for JSON, logs) or TOML (the resolved spec).

The job directory keeps ``spec.resolved.toml`` written from here, so a run can always be
repeated with exactly the values it used, defaults included, even after defaults change.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tomli_w

from relax_hpc.spec.schema import JobSpec

__all__ = ["spec_to_dict", "spec_to_toml"]


def spec_to_dict(spec: JobSpec) -> dict[str, Any]:
    """Every table and key of ``spec`` as plain dicts, lists and scalars (None where unset)."""
    return dataclasses.asdict(spec)


def _without_none(table: dict[str, Any]) -> dict[str, Any]:
    # TOML has no null: an unset optional key is simply absent, which loads back as None.
    return {
        key: _without_none(value) if isinstance(value, dict) else value
        for key, value in table.items()
        if value is not None
    }


def spec_to_toml(spec: JobSpec) -> str:
    """The fully resolved spec as TOML text; ``parse_spec`` of it gives an equal JobSpec."""
    header = "# Resolved relax-hpc job spec: every key, defaults included.\n\n"
    return header + tomli_w.dumps(_without_none(spec_to_dict(spec)))
