"""Engine kinds are decided in one place: only engines/ (which builds each kind) and spec/ (which
declares them, `RolloutSpec.on_sglang`) compare anything with "native" or "sglang"; every other
package asks the spec or the fleet."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "relax_hpc"
KINDS = {"native", "sglang"}
DECIDERS = ("engines", "spec")


def _names_a_kind(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in KINDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_kind(e) for e in node.elts)
    return False


def kind_comparisons(source: str) -> list[int]:
    """Lines of `source` that compare a value with an engine kind (==, !=, in, not in)."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
            and any(_names_a_kind(side) for side in (node.left, *node.comparators))]


def test_only_engines_and_spec_compare_engine_kinds() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in DECIDERS:
            continue
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}" for line in kind_comparisons(path.read_text())]
    assert not found, f"ask RolloutSpec.on_sglang (or the fleet) instead of comparing with an engine kind: {found}"


def test_the_check_sees_each_form_of_comparison() -> None:
    source = ('a = engine == "sglang"\nb = "native" != kind\nc = kind in ("sglang", "x")\n'
              'd = kind not in {"native"}\ne = f"engine = {kind}"\nf = kind == "torch"\n')
    assert kind_comparisons(source) == [1, 2, 3, 4]
