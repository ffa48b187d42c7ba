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
# Where code still asks which kind of engine a spec names (a spec check of media/, the rehearsal's
# mapping in launch/, the tiny model builder): not yet behind the fleet. roles/ and driver/ never.
ENGINE_KIND_CHECKS_LEFT = {"media/plan.py", "models/tiny_mm.py", "launch/rehearse.py", "launch/rehearse_spec.py",
                           "launch/image_check.py"}


def engine_imports_of_roles() -> list[str]:
    return [f"{p.relative_to(REPO)}:{line}: {m}" for p in sorted((PACKAGE / "roles").rglob("*.py"))
            for line, m in imports_of(p) if m.startswith("relax_hpc.engines") and m not in ROLES_SEE_OF_ENGINES]


def engine_kind_checks(skip: set[str]) -> list[str]:
    pattern = re.compile(r"""[!=]= *["'](native|sglang)["']|["'](native|sglang)["'] *[!=]=""")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        if rel.split("/")[0] in ("engines", "spec") or rel in skip:
            continue
        found += [f"relax_hpc/{rel}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
                  if pattern.search(line)]
    return found


def test_roles_drive_engines_through_the_fleet_and_the_engine_protocols() -> None:
    assert not engine_imports_of_roles(), "build these through engines/fleet.py:\n" + "\n".join(engine_imports_of_roles())
    checks = engine_kind_checks(ENGINE_KIND_CHECKS_LEFT)
    assert not checks, "ask engines/fleet.py what this kind of engine needs instead:\n" + "\n".join(checks)
    assert engine_kind_checks(set())  # the check can fail: the places not yet moved are found
