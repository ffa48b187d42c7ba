"""Rooms small enough to read: no module of relax_hpc/ over 600 lines, and no function over 80
lines in driver/ and roles/, where the run's control flow lives (docs/architecture.md). A module
that grows past it is split by what its parts hold, not trimmed."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "relax_hpc"
MODULE_LINES = 600
FUNCTION_LINES = 80
SHORT_FUNCTIONS_IN = ("driver", "roles")


def long_modules(limit: int = MODULE_LINES) -> list[str]:
    return [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > limit]


def long_functions(limit: int = FUNCTION_LINES) -> list[str]:
    found = []
    for package in SHORT_FUNCTIONS_IN:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if lines > limit:
                        found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.name}, {lines} lines")
    return found


def test_no_module_is_over_600_lines() -> None:
    assert not long_modules(), "split these modules by what their parts hold:\n" + "\n".join(long_modules())
    assert long_modules(limit=400)  # the check can fail


def test_no_function_in_driver_or_roles_is_over_80_lines() -> None:
    assert not long_functions(), "split these functions:\n" + "\n".join(long_functions())
    assert long_functions(limit=40)  # the check can fail
