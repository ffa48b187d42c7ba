"""The layers of docs/architecture.md hold: no package of relax_hpc imports one listed above it.

The table in docs/architecture.md is the source: its first column names the layers, top to
bottom. Every import in relax_hpc/ counts, lazy ones inside functions too (they still make the
lower layer depend on the higher one); only imports under `if TYPE_CHECKING:` are left out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "relax_hpc"


def documented_layers() -> list[str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("```", 2)[1]  # the first fenced block is the table
    rows = re.findall(r"(?m)^(\w+)\s+relax_hpc/(\w+)\s", block)
    assert rows and all(name == folder for name, folder in rows), rows
    return [name for name, _ in rows]


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported relax_hpc module) for every import in a file; relative ones resolved."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            found.append((node.lineno, module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return [(line, m) for line, m in found if m.split(".")[0] == "relax_hpc" and "." in m]


def layer_of(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def test_every_package_has_a_row_in_the_table() -> None:
    layers = documented_layers()
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages <= set(layers), f"give these packages a row in docs/architecture.md: {sorted(packages - set(layers))}"
    assert len(layers) == len(set(layers))


def upward_imports(layers: list[str]) -> list[str]:
    """Every import of a package listed above the importing one, as "file:line: ..." lines."""
    rank = {name: i for i, name in enumerate(layers)}
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = layer_of(path)
        if source not in rank:  # relax_hpc/__init__.py
            continue
        for line, module in imports_of(path):
            target = module.split(".")[1]
            if target != source and target in rank and rank[target] < rank[source]:
                upward.append(f"{path.relative_to(REPO)}:{line}: {source} imports {module} ({target} is above it)")
    return upward


def test_no_package_imports_a_layer_above_it() -> None:
    upward = upward_imports(documented_layers())
    assert not upward, "imports against docs/architecture.md's layers:\n" + "\n".join(upward)


def test_the_check_can_fail() -> None:
    # Turned upside down, the table is broken by every cross-package import, lazy ones included.
    upward = upward_imports(documented_layers()[::-1])
    assert any("relax_hpc/driver/run.py" in line and "imports relax_hpc.spec" in line for line in upward)
    lazy = {m for _, m in imports_of(PACKAGE / "rewards" / "hub.py")}
    assert "relax_hpc.rewards.ifbench" in lazy  # imported inside a method


# Inside engines/ (docs/architecture.md, "engines/"): the core modules (the engine protocol, the
# router, the native engine, sampling, ...) at the bottom, then the HTTP stack, then SGLang (its
# adapter speaks HTTP), then the elastic side (REST API, scale-out, remote engines of other jobs).
# `factory.py` and `fleet.py` assemble engines of every kind, so they alone may import any of them.
ENGINE_LAYERS = ("core", "http", "sglang", "elastic")
ENGINES = PACKAGE / "engines"
ENGINE_ASSEMBLY = {ENGINES / "factory.py", ENGINES / "fleet.py"}


def engine_layer_of(module: str) -> str:
    parts = module.split(".")  # relax_hpc.engines.<sub>.<module> or relax_hpc.engines.<module>
    return parts[2] if len(parts) > 3 and parts[2] in ENGINE_LAYERS else "core"


def upward_engine_imports(layers: tuple[str, ...]) -> list[str]:
    rank = {name: i for i, name in enumerate(layers)}
    upward = []
    for path in sorted(ENGINES.rglob("*.py")):
        if path in ENGINE_ASSEMBLY:
            continue
        source = engine_layer_of(".".join(path.relative_to(REPO).with_suffix("").parts))
        for line, module in imports_of(path):
            if module.startswith("relax_hpc.engines.") and rank[engine_layer_of(module)] > rank[source]:
                upward.append(f"{path.relative_to(REPO)}:{line}: engines/{source} imports {module}")
    return upward


def test_engine_sub_packages_import_only_downward() -> None:
    subpackages = {p.name for p in ENGINES.iterdir() if (p / "__init__.py").is_file()}
    assert subpackages == set(ENGINE_LAYERS) - {"core"}, f"give {sorted(subpackages)} a row in ENGINE_LAYERS"
    upward = upward_engine_imports(ENGINE_LAYERS)
    assert not upward, "imports against the engines' inner layers:\n" + "\n".join(upward)
    assert upward_engine_imports(ENGINE_LAYERS[::-1])  # the check can fail


# The rollout role drives engines; it does not assemble them (engines/fleet.py does). What
# roles/ may import of engines/: the engine protocol, the router's client protocol, the fleet,
# and the elastic API's reply type.
ROLES_SEE_OF_ENGINES = {"relax_hpc.engines.base", "relax_hpc.engines.router", "relax_hpc.engines.fleet",
                        "relax_hpc.engines.elastic.api"}
# Engine kinds are decided in spec/ (which declares them: `RolloutSpec.on_sglang`) and engines/
# (which builds each kind); everywhere else asks the spec or the fleet, never compares a kind.
ENGINE_KINDS = {"native", "sglang"}
KIND_DECIDERS = ("engines", "spec")


def engine_imports_of_roles() -> list[str]:
    return [f"{p.relative_to(REPO)}:{line}: {m}" for p in sorted((PACKAGE / "roles").rglob("*.py"))
            for line, m in imports_of(p) if m.startswith("relax_hpc.engines") and m not in ROLES_SEE_OF_ENGINES]


def _names_a_kind(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in ENGINE_KINDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_kind(e) for e in node.elts)
    return False


def kind_comparisons(source: str) -> list[int]:
    """Lines of `source` that compare a value with an engine kind (==, !=, in, not in)."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
            and any(_names_a_kind(side) for side in (node.left, *node.comparators))]


def engine_kind_checks() -> list[str]:
    return [f"relax_hpc/{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
            if path.relative_to(PACKAGE).parts[0] not in KIND_DECIDERS
            for line in kind_comparisons(path.read_text())]


def test_roles_drive_engines_through_the_fleet_and_the_engine_protocols() -> None:
    assert not engine_imports_of_roles(), "build these through engines/fleet.py:\n" + "\n".join(engine_imports_of_roles())
    checks = engine_kind_checks()
    assert not checks, "ask RolloutSpec.on_sglang or engines/fleet.py instead:\n" + "\n".join(checks)


def test_the_kind_check_sees_each_form_of_comparison() -> None:
    source = ('a = engine == "sglang"\nb = "native" != kind\nc = kind in ("sglang", "x")\n'
              'd = kind not in {"native"}\ne = f"engine = {kind}"\nf = kind == "torch"\n')
    assert kind_comparisons(source) == [1, 2, 3, 4]
