"""Load a TOML job spec into a validated :class:`JobSpec`, reporting every problem at once.

The loader is generic: it walks the dataclass type hints of ``relax_hpc.spec.schema`` and
never names a key itself, so a new schema field needs no loader change. The walk resolves
every value (defaults included) into a flat map keyed by TOML path, which the cross-field
checks read even when unrelated keys are broken; the JobSpec is built only when nothing
is wrong.

    from relax_hpc.spec import load_spec, SpecError
    try:
        spec = load_spec("jobspecs/tiny_local.toml")
    except SpecError as error:
        print(error)  # one "file:line: key = value: message" line per problem
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from relax_hpc.spec.constraints import Check
from relax_hpc.spec.cross_checks import CROSS_CHECKS, Resolved
from relax_hpc.spec.errors import SpecError, SpecProblem, show_value
from relax_hpc.spec.lines import KeyLocator, LineIndex
from relax_hpc.spec.peer_keys import peer_hint
from relax_hpc.spec.schema import CHECKS, SECRET, JobSpec
from relax_hpc.spec.secret_urls import SECRET_ENV_KEYS, redact_env_value, redact_value

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

__all__ = ["MAX_NESTING", "MAX_SPEC_BYTES", "check_tables", "load_spec", "parse_spec", "parse_toml",
           "read_spec_text"]

# A job spec is a few kilobytes; a file larger than this is the wrong file (or /dev/zero), and
# is refused before more of it is read.
MAX_SPEC_BYTES = 1024 * 1024
# Arrays and tables inside each other; the schema's deepest key (cluster.trainer.extra_sbatch)
# is 3 levels down. tomllib recurses per level and fails with RecursionError a few hundred down.
MAX_NESTING = 16


class _Invalid:
    """Marks a value that failed its checks (already reported)."""

    def __repr__(self) -> str:
        return "<invalid>"


INVALID = _Invalid()

_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")


def _toml_type(value: object) -> str:
    """Name a parsed TOML value's type the way the TOML format names it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return "a date/time"


def _quoted(values: tuple[object, ...] | list[str]) -> str:
    return ", ".join(f'"{value}"' if isinstance(value, str) else repr(value) for value in values)


def _optional_inner(hint: Any) -> Any | None:
    """X for ``X | None`` (or Optional[X]); None for any other hint."""
    if get_origin(hint) in (Union, types.UnionType):
        args = [arg for arg in get_args(hint) if arg is not type(None)]
        if len(args) == 1 and len(get_args(hint)) == 2:
            return args[0]
    return None


def _table_class(hint: Any) -> type | None:
    """The dataclass behind a sub-table hint (plain or optional), else None."""
    inner = _optional_inner(hint)
    candidate = hint if inner is None else inner
    return candidate if isinstance(candidate, type) and dataclasses.is_dataclass(candidate) else None


class _Walker:
    """One pass over the parsed TOML; collects problems and resolved values."""

    def __init__(self, lines: KeyLocator) -> None:
        self.lines = lines
        self.problems: list[SpecProblem] = []
        self.resolved: dict[str, Any] = {}
        # Keys whose values are secrets (SECRET): their problems show the value redacted.
        self.secret_keys: set[str] = set()

    def problem(self, key: str, value: object, message: str, allowed: str | None = None) -> _Invalid:
        line = self.lines.line_of(key)
        if key.partition("[")[0] in self.secret_keys:
            value = redact_value(value)
        elif key.partition("[")[0] in SECRET_ENV_KEYS:
            message = _without_env_values(message, value)
            value = redact_env_value(value)
        self.problems.append(SpecProblem(key, show_value(value), message, allowed, line, self.lines.where_of(key)))
        return INVALID

    def table(self, cls: type, raw: dict[str, Any], prefix: str) -> Any:
        """Check one table against its dataclass; the instance, or INVALID."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = get_type_hints(cls)
        dot = f"{prefix}." if prefix else ""
        # A misspelt key of a table with secrets ("url" for "urls") may well hold one.
        has_secrets = any(f.metadata.get(SECRET) for f in fields.values())
        has_env_secrets = any(f"{dot}{name}" in SECRET_ENV_KEYS for name in fields)
        self.secret_keys.update(f"{dot}{name}" for name, f in fields.items() if f.metadata.get(SECRET))
        for unknown in (name for name in raw if name not in fields):
            shown = raw[unknown]
            if has_secrets:
                shown = redact_value(shown)
            elif has_env_secrets:
                shown = redact_env_value(shown)
            self._unknown_key(f"{dot}{unknown}", unknown, shown, list(fields))
        values: dict[str, Any] = {}
        for name, spec_field in fields.items():
            key = f"{dot}{name}"
            hint = hints[name]
            if name in raw:
                value = self.value(hint, raw[name], key, spec_field.metadata.get(CHECKS, ()))
            elif (sub := _table_class(hint)) is not None and _optional_inner(hint) is None:
                # An absent sub-table is an empty one: its defaults apply and each of its
                # required keys is reported by name.
                value = self.table(sub, {}, key)
            elif spec_field.default is not dataclasses.MISSING:
                value = spec_field.default
            elif spec_field.default_factory is not dataclasses.MISSING:
                value = spec_field.default_factory()
            else:
                where = f"[{prefix}]" if prefix else "the top level"
                message = f"required key is missing; set it under {where}"
                self.problems.append(SpecProblem(key=key, value=None, message=message))
                value = INVALID
            self.resolved[key] = value
            values[name] = value
        if any(value is INVALID for value in values.values()):
            return INVALID
        return cls(**values)

    def _unknown_key(self, key: str, name: str, value: object, known: list[str]) -> None:
        is_table = isinstance(value, dict)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        message = f"unknown {'table' if is_table else 'key'}"
        # Another framework's name for one of ours says more than a near spelling of it.
        peer = peer_hint(key)
        if peer is not None:
            message += f" ({peer})"
        elif close:
            message += f' (did you mean "{close[0]}"?)'
        else:
            home = _owning_tables(name)
            if home:
                message += f" ({name} belongs in {' or '.join(f'[{table}]' for table in home)})"
        # A whole table is not worth printing; its header line is shown instead.
        value_shown = None if is_table else show_value(value)
        line = self.lines.line_of(key)
        self.problems.append(SpecProblem(key, value_shown, message, _quoted(known), line, self.lines.where_of(key)))

    def value(self, hint: Any, raw: object, key: str, checks: tuple[Check, ...] = ()) -> Any:
        """Check one value against its type hint and checks; the converted value, or INVALID."""
        inner = _optional_inner(hint)
        if inner is not None:
            return self.value(inner, raw, key, checks)
        converted = self._typed(hint, raw, key)
        if converted is INVALID:
            return INVALID
        for check in checks:
            message = check(converted)
            if message is not None:
                return self.problem(key, raw, message)
        return converted

    def _typed(self, hint: Any, raw: object, key: str) -> Any:
        cls = _table_class(hint)
        if cls is not None:
            if not isinstance(raw, dict):
                return self.problem(key, raw, f"expected a table, got {_toml_type(raw)}")
            return self.table(cls, raw, key)
        origin = get_origin(hint)
        if origin is Literal:
            allowed = get_args(hint)
            if isinstance(raw, str) and raw in allowed:
                return raw
            return self.problem(key, raw, "is not one of the allowed values", _quoted(allowed))
        if origin is list:
            if not isinstance(raw, list):
                return self.problem(key, raw, f"expected an array, got {_toml_type(raw)}")
            (item_hint,) = get_args(hint)
            items = [self._typed(item_hint, item, f"{key}[{index}]") for index, item in enumerate(raw)]
            return INVALID if any(item is INVALID for item in items) else items
        if hint is bool:
            if isinstance(raw, bool):
                return raw
            return self.problem(key, raw, f"expected a boolean, got {_toml_type(raw)}", "true, false")
        if hint is int:
            if isinstance(raw, int) and not isinstance(raw, bool):
                return raw
            return self.problem(key, raw, f"expected an integer, got {_toml_type(raw)}")
        if hint is float:
            # Integers are fine where a float is expected (lr = 1 is 1.0); booleans are not.
            if isinstance(raw, (int, float)) and not isinstance(raw, bool):
                number = _finite(raw)
                if number is None:
                    return self.problem(key, raw, "must be a finite number (not inf or nan, "
                                                  "and within about ±1.8e308)")
                return number
            return self.problem(key, raw, f"expected a number, got {_toml_type(raw)}")
        if hint is str:
            if isinstance(raw, str):
                return raw
            return self.problem(key, raw, f"expected a string, got {_toml_type(raw)}")
        raise TypeError(f"schema field {key} has unsupported type {hint!r}; see relax_hpc/spec/schema.py")


def _without_env_values(message: str, value: object) -> str:
    """``message`` with every assignment of ``value`` that it quotes (text_checks.items names the
    element that fails as ``show_value(element)``) shown redacted."""
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, str):
            message = message.replace(show_value(item), show_value(redact_env_value(item)))
    return message


def _finite(value: float) -> float | None:
    """``value`` as a float, or None when it is inf, nan or an integer too large for a float."""
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def schema_keys(cls: type = JobSpec, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field]]:
    """(its table's path, its field) for every key of the schema that is not a table, depth first
    ("" for the top level, "rollout.sglang" for a nested table)."""
    hints = get_type_hints(cls)
    for spec_field in dataclasses.fields(cls):
        sub = _table_class(hints[spec_field.name])
        if sub is not None:
            yield from schema_keys(sub, f"{prefix}.{spec_field.name}" if prefix else spec_field.name)
        else:
            yield prefix, spec_field


@functools.cache
def _tables_by_key() -> dict[str, tuple[str, ...]]:
    """{key name: the tables of the schema that have it}, built once (get_type_hints is slow,
    and a spec with thousands of unknown keys asks once per key)."""
    found: dict[str, list[str]] = {}
    for table, spec_field in schema_keys():
        if table:
            found.setdefault(spec_field.name, []).append(table)
    return {name: tuple(tables) for name, tables in found.items()}


def _owning_tables(name: str) -> tuple[str, ...]:
    """Tables of the schema that have a key called ``name`` (for misplaced keys)."""
    return _tables_by_key().get(name, ())


def _syntax_problem(error: tomllib.TOMLDecodeError) -> SpecProblem:
    text = str(error)
    position = _TOML_POSITION.search(text)
    if position is None:
        return SpecProblem(key="", value=None, message=f"invalid TOML: {text}")
    message = f"invalid TOML: {text[: position.start()]} (column {position.group(2)})"
    return SpecProblem(key="", value=None, message=message, line=int(position.group(1)))


def _file_problem(message: str, source: str) -> SpecError:
    """The error for a problem of the whole file (no key, no line)."""
    return SpecError([SpecProblem(key="", value=None, message=message)], source)


def _too_large(source: str) -> SpecError:
    message = (f"is larger than {MAX_SPEC_BYTES // (1024 * 1024)} MiB; a job spec is a few kilobytes: "
               "check that this is the spec file")
    return _file_problem(message, source)


def _too_deep(source: str) -> SpecError:
    message = (f"is nested too deeply: arrays and tables may be nested at most {MAX_NESTING} levels "
               "(a job spec needs 3)")
    return _file_problem(message, source)


def _nesting(value: object) -> int:
    """How many arrays and tables are nested in ``value`` at the deepest point (no recursion)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """tomllib.loads, with every way it can fail turned into a one-line SpecError."""
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise _too_large(source)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise SpecError([_syntax_problem(error)], source) from None
    except RecursionError:
        raise _too_deep(source) from None
    except ValueError as error:
        # Python refuses to read integers of more than 4300 digits (sys.get_int_max_str_digits()).
        reason = "an integer has too many digits" if "integer string conversion" in str(error) else str(error)
        raise _file_problem(f"invalid TOML: {reason}", source) from None
    # The root table counts as level 1.
    if _nesting(raw) > MAX_NESTING + 1:
        raise _too_deep(source)
    return raw


def parse_spec(text: str, source: str = "<string>") -> JobSpec:
    """Validate spec text; the JobSpec, or SpecError listing every problem.

    ``source`` names the text in the report (normally the file path).
    """
    return check_tables(parse_toml(text, source), LineIndex(text), source)


def check_tables(raw: dict[str, Any], lines: KeyLocator, source: str,
                 problems: list[SpecProblem] | None = None) -> JobSpec:
    """Validate parsed TOML tables; the JobSpec, or SpecError listing every problem.

    ``lines`` places each problem (one file's LineIndex, or the origins of a composed spec);
    ``problems`` are ones found before (a malformed override), reported with the rest.
    """
    walker = _Walker(lines)
    walker.problems.extend(problems or [])
    spec = walker.table(JobSpec, raw, "")
    resolved = Resolved(walker.resolved, INVALID)
    for check in CROSS_CHECKS:
        for problem in check(resolved):
            key = problem.key
            walker.problems.append(dataclasses.replace(problem, line=lines.line_of(key), where=lines.where_of(key)))
    if walker.problems:
        # File order reads best (for composed specs: file by file, then the overrides);
        # problems without a place (missing keys) go last.
        def place(problem: SpecProblem) -> tuple[bool, tuple[int, int]]:
            if problem.line is None and problem.where is None:
                return True, (0, 0)
            return False, lines.position(problem.key) or (0, problem.line or 0)

        raise SpecError(sorted(walker.problems, key=place), source)
    assert isinstance(spec, JobSpec), "no problems were found, so every table resolved"
    return spec


def _read_capped(path: str | Path) -> bytes:
    """The file's bytes, reading at most MAX_SPEC_BYTES + 1 of them (enough to tell it is too large)."""
    chunks, left = [], MAX_SPEC_BYTES + 1
    with open(path, "rb") as handle:
        while left > 0:
            chunk = handle.read(left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    return b"".join(chunks)


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a TOML job spec file; SpecError names the path on any problem."""
    return parse_spec(read_spec_text(path), str(path))


def read_spec_text(path: str | Path) -> str:
    """The text of a spec file; SpecError (naming the path) when it is missing, too large or not UTF-8."""
    source = str(path)
    try:
        data = _read_capped(path)
    except FileNotFoundError:
        message = "no such file; pass the path of a TOML job spec (see jobspecs/ for examples)"
        raise _file_problem(message, source) from None
    except IsADirectoryError:
        raise _file_problem("is a directory; pass the path of a TOML job spec file", source) from None
    except OSError as error:
        raise _file_problem(f"cannot read the file: {error.strerror or error}", source) from None
    if len(data) > MAX_SPEC_BYTES:
        raise _too_large(source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        message = f"not UTF-8 text (byte {error.start}); TOML files must be UTF-8"
        raise _file_problem(message, source) from None
    return text
