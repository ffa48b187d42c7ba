"""docs/spec.md documents exactly the schema's tables, keys and defaults."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, get_args, get_type_hints

from relax_hpc.spec import JobSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DOC = Path(__file__).resolve().parents[2] / "docs" / "spec.md"
_ROW = re.compile(r"^\| `([a-z_]+)` \| [^|]*(?:\\\|[^|]*)* \| ([^|]+) \|")


def documented_rows() -> dict[str, dict[str, str]]:
    """{table path: {key: default cell}} from the reference tables of docs/spec.md."""
    rows: dict[str, dict[str, str]] = {}
    tables: list[str] = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            tables = re.findall(r"\[([a-z_.]+)\]", line)
            continue
        row = _ROW.match(line)
        if row is not None:
            for table in tables:
                rows.setdefault(table, {})[row.group(1)] = row.group(2).strip()
    return rows


def schema_tables() -> dict[str, dict[str, dataclasses.Field[Any]]]:
    """{table path: {key: field}} for every leaf key of the schema."""
    found: dict[str, dict[str, dataclasses.Field[Any]]] = {}

    def visit(cls: type, prefix: str) -> None:
        hints = get_type_hints(cls)
        for spec_field in dataclasses.fields(cls):
            path = f"{prefix}.{spec_field.name}" if prefix else spec_field.name
            # A sub-table is a dataclass, possibly optional (X | None).
            hint = hints[spec_field.name]
            subs = [t for t in (hint, *get_args(hint)) if dataclasses.is_dataclass(t)]
            if subs:
                sub = subs[0]
                assert isinstance(sub, type)
                visit(sub, path)
            else:
                found.setdefault(prefix, {})[spec_field.name] = spec_field

    visit(JobSpec, "")
    return found


def test_every_key_is_documented_with_its_default() -> None:
    documented = documented_rows()
    schema = schema_tables()
    assert set(documented) == set(schema)
    for table, fields in schema.items():
        assert set(documented[table]) == set(fields), table
        for name, spec_field in fields.items():
            cell = documented[table][name]
            if spec_field.default is dataclasses.MISSING and spec_field.default_factory is dataclasses.MISSING:
                assert cell == "*required*", f"{table}.{name}"
            elif spec_field.default is None:
                assert cell == "optional", f"{table}.{name}"
            else:
                default = spec_field.default
                if spec_field.default_factory is not dataclasses.MISSING:
                    default = spec_field.default_factory()
                value = tomllib.loads(f"v = {cell.strip('`')}")["v"]
                assert value == default, f"{table}.{name}: documented {cell}, schema {default!r}"
