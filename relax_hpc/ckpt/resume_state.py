"""The small, JSON-serialisable part of a checkpoint: where training stands.

``ResumeState`` holds what the driver needs besides tensors to continue a run exactly:
the number of completed steps, the weight version the rollout engines must reach, the
dataset cursor and the sample count. It is written next to the DCP files as
``resume.json``::

    {"format": 1, "world_size": 2, "resume_state": {"step": 10, ...}}

``world_size`` records how many ranks wrote ``rng_rank<r>.pt`` files, so a reader can
tell a missing file (corruption) from a job restarted with more ranks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relax_hpc.ckpt.fs import atomic_write_text

__all__ = [
    "RESUME_FILE",
    "RESUME_FORMAT",
    "ResumeFile",
    "ResumeState",
    "read_resume_file",
    "write_resume_file",
]

RESUME_FILE = "resume.json"
RESUME_FORMAT = 1


@dataclass
class ResumeState:
    """Where a training run stands after ``step`` completed steps."""

    step: int
    weight_version: int
    data_cursor: dict[str, Any]
    samples_trained: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form; raises ValueError when a field cannot be written as JSON."""
        data = asdict(self)
        try:
            json.dumps(data, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"ResumeState is not JSON-serialisable ({exc}); data_cursor and extra may only "
                "hold dict/list/str/int/float/bool/None (no tensors, numpy scalars, NaN or inf)"
            ) from exc
        return data

    @classmethod
    def from_dict(cls, data: object) -> ResumeState:
        """Build from the dict in resume.json, checking every field's type."""
        if not isinstance(data, dict):
            raise ValueError(f"resume_state must be a JSON object, got {type(data).__name__}")
        problems: list[str] = []
        for key in ("step", "weight_version", "samples_trained"):
            value = data.get(key)
            # bool is an int subclass; a true/false step is a bug, not a count.
            if not isinstance(value, int) or isinstance(value, bool):
                problems.append(f"{key}={value!r} must be an integer")
            elif value < 0:
                problems.append(f"{key}={value!r} must be >= 0")
        for key in ("data_cursor", "extra"):
            if not isinstance(data.get(key, {}), dict):
                problems.append(f"{key}={data.get(key)!r} must be a JSON object")
        unknown = sorted(set(data) - {"step", "weight_version", "data_cursor", "samples_trained", "extra"})
        if unknown:
            problems.append(f"unknown keys {unknown}")
        if "data_cursor" not in data:
            problems.append("data_cursor is missing")
        if problems:
            raise ValueError("invalid resume_state: " + "; ".join(problems))
        return cls(
            step=data["step"],
            weight_version=data["weight_version"],
            data_cursor=dict(data["data_cursor"]),
            samples_trained=data["samples_trained"],
            extra=dict(data.get("extra", {})),
        )


@dataclass(frozen=True)
class ResumeFile:
    """Contents of resume.json: the state plus how the checkpoint was written."""

    state: ResumeState
    world_size: int


def write_resume_file(directory: Path, state: ResumeState, world_size: int) -> None:
    """Write ``directory/resume.json`` durably (write-then-rename)."""
    payload = {"format": RESUME_FORMAT, "world_size": world_size, "resume_state": state.to_dict()}
    atomic_write_text(directory / RESUME_FILE, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_resume_file(directory: Path) -> ResumeFile:
    """Read and validate ``directory/resume.json``; raises ValueError or OSError when unusable."""
    path = directory / RESUME_FILE
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text: {exc}") from exc
    if not isinstance(payload, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(payload).__name__}")
    if payload.get("format") != RESUME_FORMAT:
        raise ValueError(
            f"{path} has format={payload.get('format')!r}; this relax-hpc reads format {RESUME_FORMAT}"
        )
    world_size = payload.get("world_size")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"{path} has world_size={world_size!r}; expected an integer >= 1")
    return ResumeFile(state=ResumeState.from_dict(payload.get("resume_state")), world_size=world_size)
