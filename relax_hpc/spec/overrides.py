"""`--set KEY=VALUE` overrides: parsed, checked against the schema's shape, and set into the tables.

The value is read as a TOML value (``1e-6``, ``4``, ``true``, ``"text"``, ``[1, 2]``); text that
is not one (``my-run``, ``/data/x.jsonl``) is taken as a string, and so is any value of a key
whose type is a string (``--set cluster.trainer.time=02:00:00`` is not a TOML time here). The
result is then checked by the loader like a value written in the file.

    overrides = parse_overrides(["train.lr=1e-6", "rollout.num_engines=4"])
    problems = set_overrides(tables, overrides)   # refusals; the rest is set into ``tables``
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_origin, get_type_hints

from relax_hpc.spec.errors import SpecError, SpecProblem, show_value
from relax_hpc.spec.loader import _optional_inner, _table_class, parse_toml, schema_keys
from relax_hpc.spec.schema import SECRET, JobSpec
from relax_hpc.spec.secret_urls import SECRET_ENV_KEYS

__all__ = ["FORM", "Override", "parse_override", "parse_overrides", "set_overrides"]

FORM = "--set KEY=VALUE, e.g. --set train.lr=1e-6 or --set cluster.trainer.nodes=2"
_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
_VALUE_KEY = "value"


@dataclass(frozen=True)
class Override:
    """One ``--set KEY=VALUE``: the dotted key, the value as typed, and the value read from it."""

    key: str
    text: str
    value: Any

    @property
    def hidden(self) -> bool:
        """Whether the value is kept out of reports: it is set in a table that holds secrets."""
        return self.key.rpartition(".")[0] in _secret_tables() or self.key in _secret_tables()

    @property
    def shown(self) -> str:
        """How reports name it: as typed, but ``***`` for a hidden value."""
        return f"--set {self.key}={'***' if self.hidden else self.text}"


@functools.cache
def _secret_tables() -> frozenset[str]:
    """Tables with a key whose values are secrets ([notify] urls, [container] env): a misspelt key
    there may hold one too."""
    tables = {key.rpartition(".")[0] for key in SECRET_ENV_KEYS}
    tables.update(table for table, spec_field in schema_keys() if spec_field.metadata.get(SECRET))
    return frozenset(tables)


def _form_error(text: str, why: str) -> SpecProblem:
    return SpecProblem(key="", value=None, message=f"{why}; expected {FORM}", where=f"--set {text}")


def parse_override(text: str) -> Override | SpecProblem:
    """One ``KEY=VALUE``; the problem (naming the expected form) when it is not one."""
    key, equals, value_text = text.partition("=")
    key, value_text = key.strip(), value_text.strip()
    if not equals:
        return _form_error(text, "no '=' between the key and the value")
    if not key:
        return _form_error(text, "the key before '=' is empty")
    if _KEY.fullmatch(key) is None:
        return _form_error(text, f"{key!r} is not a dotted key of letters, digits, '_' and '-'")
    return Override(key, value_text, _toml_value(key, value_text))


def parse_overrides(texts: Sequence[str]) -> list[Override]:
    """Every ``KEY=VALUE``; SpecError naming each malformed one (all at once)."""
    parsed = [parse_override(text) for text in texts]
    problems = [item for item in parsed if isinstance(item, SpecProblem)]
    if problems:
        raise SpecError(problems, "--set")
    return [item for item in parsed if isinstance(item, Override)]


def _toml_value(key: str, text: str) -> Any:
    """``text`` read as one TOML value; the text itself when it is not one, or when the key is a string's."""
    try:
        value = _one_value(text)
    except ValueError:
        return text
    if _is_string_key(key) and not isinstance(value, str):
        return text  # job.name=123 and cluster.trainer.time=02:00:00 stay as typed
    return value


def _one_value(text: str) -> Any:
    try:
        parsed = parse_toml(f"{_VALUE_KEY} = {text}", "--set")
    except SpecError:
        raise ValueError(text) from None
    if list(parsed) != [_VALUE_KEY]:  # a newline in the text made more than one assignment
        raise ValueError(text)
    return parsed[_VALUE_KEY]


def _schema_at(key: str) -> tuple[str, Any] | None:
    """("table", cls), ("key", hint) or ("through", prefix) for a dotted path of the schema; None when
    a part is not in it (the loader reports the unknown key)."""
    cls: type = JobSpec
    parts = key.split(".")
    for index, part in enumerate(parts):
        hints = get_type_hints(cls)
        if part not in hints:
            return None
        sub = _table_class(hints[part])
        last = index == len(parts) - 1
        if sub is None:
            return ("key", hints[part]) if last else ("through", ".".join(parts[: index + 1]))
        if last:
            return "table", sub
        cls = sub
    raise AssertionError("a key has at least one part")


def _is_string_key(key: str) -> bool:
    found = _schema_at(key)
    if found is None or found[0] != "key":
        return False
    hint = _optional_inner(found[1]) or found[1]
    return hint is str or get_origin(hint) is Literal


def _refusal(override: Override) -> str | None:
    """Why ``override`` cannot be set, judged by the schema alone; None when it can."""
    found = _schema_at(override.key)
    if found is None:
        return None
    kind, detail = found
    if kind == "table":
        first = dataclasses.fields(detail)[0].name
        return (f"{override.key} is a table, which --set does not replace: set its keys one at a time, "
                f"e.g. --set {override.key}.{first}=...")
    if kind == "through":
        return f"{detail} is a key, not a table: set it as --set {detail}=VALUE"
    if isinstance(override.value, dict):
        return f"{override.key} takes a value, not a table: pass one, as in --set {override.key}=VALUE"
    return None


def set_overrides(tables: dict[str, Any], overrides: Sequence[Override]) -> list[SpecProblem]:
    """Set each override into ``tables`` (the merged spec files), in order; the problems of those
    refused (a whole table, a path through a key), each naming its --set. The rest is left to the
    loader's checks: an unknown key, a wrong type."""
    problems: list[SpecProblem] = []
    for override in overrides:
        why = _refusal(override) or _set_into(tables, override)
        if why is not None:
            shown = None if override.hidden else show_value(override.value)
            problems.append(SpecProblem(override.key, shown, why, where=override.shown))
    return problems


def _set_into(tables: dict[str, Any], override: Override) -> str | None:
    parts = override.key.split(".")
    node = tables
    for index, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            path = ".".join(parts[: index + 1])
            return f"{path} is set to a value, not a table, so {override.key} cannot be set inside it"
        node = child
    node[parts[-1]] = override.value
    return None
