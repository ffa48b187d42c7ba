"""A job spec composed of several files and ``--set`` overrides, and where each value came from.

Files merge left to right: tables merge key by key (recursively), and a later value (a number,
a string, an array) replaces an earlier one. The overrides are set on top, in order. The merged
tables go through the same checks as one file (``loader.check_tables``), and every problem names
where its value was given: ``overlay.toml:3`` or ``--set train.lr=abc``.

    composed = compose_spec(["base.toml", "overlay.toml"], ["train.lr=1e-6"])
    composed.spec                        # the JobSpec
    composed.origins.where_of("train.lr")  # "--set train.lr=1e-6"
    annotate_origins(spec_to_toml(composed.spec), composed.origins)  # "lr = 1e-06  # --set"
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from relax_hpc.spec.lines import LineIndex
from relax_hpc.spec.loader import check_tables, parse_toml, read_spec_text
from relax_hpc.spec.overrides import Override, parse_overrides, set_overrides
from relax_hpc.spec.schema import JobSpec

__all__ = ["ComposedSpec", "Origin", "Origins", "annotate_origins", "compose_spec", "merge_tables"]

_INDEX = re.compile(r"\[\d+\]$")


@dataclass(frozen=True)
class Origin:
    """Where one key's value was given: a file and its line, or an override."""

    layer: int  # 0 for the first file, then the next files, then each --set
    source: str  # the file, or "--set"
    line: int | None = None
    override: str | None = None  # the --set as reports show it

    def where(self) -> str:
        if self.override is not None:
            return self.override
        return self.source if self.line is None else f"{self.source}:{self.line}"

    def comment(self) -> str:
        """The note `relax-hpc show` writes after the value ("base.toml:12", "--set")."""
        return "--set" if self.override is not None else self.where()


class Origins:
    """Key path -> Origin for every value given (and every table written), the last layer winning;
    a KeyLocator for the loader's report."""

    def __init__(self) -> None:
        self._values: dict[str, Origin] = {}
        self._tables: dict[str, Origin] = {}

    def add_file(self, layer: int, source: str, tables: dict[str, Any], lines: LineIndex) -> None:
        for key, is_table in _paths(tables, ""):
            origin = Origin(layer, source, lines.line_of(key))
            if is_table:
                self._tables.setdefault(key, origin)  # where it was first written
                self._values.pop(key, None)  # a value of an earlier file that this table replaces
            else:
                self._replace(key, origin)

    def add_override(self, layer: int, override: Override) -> None:
        parts = override.key.split(".")
        origin = Origin(layer, "--set", None, override.shown)
        for end in range(1, len(parts)):
            self._tables.setdefault(".".join(parts[:end]), origin)
        self._replace(override.key, origin)

    def _replace(self, key: str, origin: Origin) -> None:
        self._values[key] = origin
        for inside in [given for given in self._values if given.startswith(key + ".")]:
            del self._values[inside]  # the values of a table that this value replaces

    def given(self) -> dict[str, Origin]:
        """Every key whose value was given, with where."""
        return dict(self._values)

    def origin_of(self, key: str) -> Origin | None:
        """The key's origin; for a key inside an inline table or an array, its enclosing key's."""
        path = _INDEX.sub("", key)
        if path in self._values:
            return self._values[path]
        if path in self._tables:
            return self._tables[path]
        parts = path.split(".")
        for end in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:end])
            if parent in self._values:
                return self._values[parent]
        return None

    def line_of(self, key: str) -> int | None:
        origin = self.origin_of(key)
        return None if origin is None else origin.line

    def where_of(self, key: str) -> str | None:
        origin = self.origin_of(key)
        return None if origin is None else origin.where()

    def position(self, key: str) -> tuple[int, int] | None:
        origin = self.origin_of(key)
        return None if origin is None else (origin.layer, origin.line or 0)


def _paths(table: dict[str, Any], prefix: str) -> Iterator[tuple[str, bool]]:
    """(dotted key, is a table) for every table and value in ``table``, depth first."""
    for name, value in table.items():
        key = f"{prefix}.{name}" if prefix else name
        if isinstance(value, dict):
            yield key, True
            yield from _paths(value, key)
        else:
            yield key, False


def merge_tables(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``overlay`` merged onto a copy of ``base``: tables merge recursively, anything else replaces."""
    merged = copy.deepcopy(base)
    for name, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = merge_tables(merged[name], value)
        else:
            merged[name] = copy.deepcopy(value)
    return merged


@dataclass(frozen=True)
class ComposedSpec:
    """The spec of some files and overrides, where its values came from, and what it was made of."""

    spec: JobSpec
    origins: Origins
    paths: tuple[str, ...]
    texts: tuple[str, ...]  # each file as written
    overrides: tuple[Override, ...]
    label: str  # names it in messages: the path, or "base.toml + overlay.toml --set train.lr=1e-6"

    def original_text(self) -> str:
        """What the spec was made of, as written: the one file, or each file and then the overrides
        (commented, for reading: it is not itself a spec to load)."""
        if len(self.paths) == 1 and not self.overrides:
            return self.texts[0]
        parts = [f"# relax-hpc spec composed of: {self.label}\n"]
        for path, text in zip(self.paths, self.texts):
            parts.append(f"\n# ---- {path} ----\n{text}" + ("" if text.endswith("\n") else "\n"))
        if self.overrides:
            parts.append("\n# ---- then ----\n" + "".join(f"# --set {o.key}={o.text}\n" for o in self.overrides))
        return "".join(parts)


def compose_label(paths: Sequence[str], overrides: Sequence[Override]) -> str:
    return " + ".join(paths) + "".join(f" {override.shown}" for override in overrides)


def compose_spec(paths: Sequence[str], overrides: Sequence[str] = ()) -> ComposedSpec:
    """The spec of ``paths`` merged left to right with ``overrides`` ("KEY=VALUE") on top;
    SpecError with every problem, each naming its file and line or its --set."""
    if not paths:
        raise ValueError("pass at least one spec file")
    parsed = parse_overrides(overrides)
    merged: dict[str, Any] = {}
    origins = Origins()
    texts: list[str] = []
    for layer, path in enumerate(paths):
        text = read_spec_text(path)
        tables = parse_toml(text, path)
        origins.add_file(layer, path, tables, LineIndex(text))
        merged = merge_tables(merged, tables)
        texts.append(text)
    for layer, override in enumerate(parsed, start=len(paths)):
        origins.add_override(layer, override)
    problems = set_overrides(merged, parsed)
    label = compose_label(paths, parsed)
    spec = check_tables(merged, origins, label, problems)
    return ComposedSpec(spec, origins, tuple(paths), tuple(texts), tuple(parsed), label)


def annotate_origins(text: str, origins: Origins) -> str:
    """Spec TOML (as spec_to_toml writes it) with ``# where`` after each value that was given."""
    index = LineIndex(text)
    notes: dict[int, str] = {}
    for key, origin in origins.given().items():
        line = index.exact_line(key)
        if line is not None:
            notes[line] = origin.comment()
    lines = text.splitlines(keepends=True)
    for number, note in notes.items():
        body = lines[number - 1].rstrip("\n")
        lines[number - 1] = f"{body}  # {note}\n"
    return "".join(lines)
