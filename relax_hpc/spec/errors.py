"""Problems found in a job spec, and the one exception that carries all of them.

A spec is checked completely before anything runs: every problem (unknown key, wrong type,
value out of range, missing key, impossible combination) becomes one :class:`SpecProblem`,
and :class:`SpecError` reports them all at once, one line each, in the familiar
``file:line: message`` form that editors and terminals make clickable.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SpecError", "SpecProblem", "show_value"]

# Where to read about every table and key; printed under each report.
SPEC_REFERENCE = "docs/spec.md"

# A bad value is shown in the report; a whole table pasted where a number belongs should
# not flood the terminal.
_MAX_VALUE_CHARS = 80


def show_value(value: object) -> str:
    """The repr of a bad value, shortened so that one problem stays one line."""
    text = repr(value)
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 3] + "..."
    return text


@dataclass(frozen=True)
class SpecProblem:
    """One thing wrong with a job spec.

    key:     TOML key path, e.g. ``"rollout.top_p"``; ``""`` for problems of the whole file
             (unreadable file, malformed TOML).
    value:   repr of the offending value, or None when there is none (e.g. a missing key).
    message: what is wrong and, where it helps, what to do.
    allowed: the allowed values when they form a finite set (``'"colocate", "async"'``).
    line:    1-based line in the file where the key is written, or None when unknown.
    where:   where the value was given, when that is not ``source:line`` of the report: a spec
             composed of several files names the file (``overlay.toml:3``), an override its
             ``--set KEY=VALUE``; None for one file.
    """

    key: str
    value: str | None
    message: str
    allowed: str | None = None
    line: int | None = None
    where: str | None = None

    def format(self, source: str) -> str:
        """One report line: ``source:line: key = value: message; allowed: ...``."""
        where = self.where
        if where is None:
            where = source if self.line is None else f"{source}:{self.line}"
        what = self.key
        if self.value is not None:
            what = f"{self.key} = {self.value}" if self.key else self.value
        text = f"{where}: {what}: {self.message}" if what else f"{where}: {self.message}"
        if self.allowed is not None:
            text += f"; allowed: {self.allowed}"
        return text


class SpecError(Exception):
    """Every problem found in one job spec; ``str(error)`` is the full human report."""

    def __init__(self, problems: list[SpecProblem], source: str) -> None:
        # Passing both to Exception keeps the error picklable (Ray ships exceptions
        # between processes by re-calling the constructor with ``args``).
        super().__init__(problems, source)
        self.problems: list[SpecProblem] = list(problems)
        self.source: str = source

    def __str__(self) -> str:
        count = len(self.problems)
        noun = "problem" if count == 1 else "problems"
        lines = [f"invalid job spec {self.source} ({count} {noun}):"]
        lines += [problem.format(self.source) for problem in self.problems]
        lines.append(f"See {SPEC_REFERENCE} for every table, key and default.")
        return "\n".join(lines)
