"""Best-effort line numbers for TOML key paths, found by scanning the source text.

tomllib returns plain dicts without positions, so problems are located afterwards: the
scanner follows ``[table]`` headers and ``key = value`` lines (dotted keys included) and
remembers where each full key path is first written. Keys inside inline tables or
multi-line values fall back to the line of the nearest enclosing key; anything not found
gives None. A wrong line would mislead more than no line, so the scanner stays simple and
only claims lines it recognises.
"""

from __future__ import annotations

import re
from typing import Protocol

__all__ = ["KeyLocator", "LineIndex"]

_HEADER = re.compile(r"^\s*\[\[?\s*([^\[\]]+?)\s*\]\]?\s*(#.*)?$")
# One part of a key: bare, "double-quoted" or 'single-quoted'.
_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')"""
_ASSIGNMENT = re.compile(rf"^\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*=")
_PART = re.compile(_KEY_PART)
_INDEX = re.compile(r"\[\d+\]$")


class KeyLocator(Protocol):
    """Where a key path was written: what a problem report needs to place each problem."""

    def line_of(self, key: str) -> int | None: ...

    def where_of(self, key: str) -> str | None: ...

    def position(self, key: str) -> tuple[int, int] | None: ...


def _parts(dotted: str) -> tuple[str, ...]:
    return tuple(part.strip("\"'") for part in _PART.findall(dotted))


class LineIndex:
    """Maps TOML key paths (``"cluster.trainer.nodes"``) to 1-based line numbers."""

    def __init__(self, text: str) -> None:
        self._keys: dict[tuple[str, ...], int] = {}
        self._tables: dict[tuple[str, ...], int] = {}
        table: tuple[str, ...] = ()
        in_multiline_string = False
        for number, line in enumerate(text.splitlines(), start=1):
            # Lines inside a """...""" value are text, not keys.
            if line.count('"""') % 2 == 1 or line.count("'''") % 2 == 1:
                was_inside = in_multiline_string
                in_multiline_string = not in_multiline_string
                if was_inside:
                    continue
            elif in_multiline_string:
                continue
            header = _HEADER.match(line)
            if header is not None:
                table = _parts(header.group(1))
                self._tables.setdefault(table, number)
                continue
            assignment = _ASSIGNMENT.match(line)
            if assignment is not None:
                self._keys.setdefault(table + _parts(assignment.group(1)), number)

    def where_of(self, key: str) -> str | None:
        """None: in a report of one file, ``source:line`` names the place (KeyLocator)."""
        return None

    def position(self, key: str) -> tuple[int, int] | None:
        """(0, line) of ``key`` for ordering a report by place in the file; None without a line."""
        line = self.line_of(key)
        return None if line is None else (0, line)

    def exact_line(self, key: str) -> int | None:
        """Line of the assignment of exactly ``key`` (no parent, no table header); None if not written."""
        return self._keys.get(tuple(key.split(".")))

    def line_of(self, key: str) -> int | None:
        """Line where ``key`` (or, for keys inside inline tables, its parent) is written.

        ``key`` may end in a list index (``"rollout.stop[1]"``), which maps to the list's key;
        a table path maps to its ``[header]`` line.
        """
        path = tuple(_INDEX.sub("", key).split("."))
        if path in self._keys:
            return self._keys[path]
        if path in self._tables:
            return self._tables[path]
        for end in range(len(path) - 1, 0, -1):
            if path[:end] in self._keys:
                return self._keys[path[:end]]
        return None
