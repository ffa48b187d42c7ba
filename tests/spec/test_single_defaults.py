"""Every default of the job spec is declared once, in relax_hpc/spec/schema.py.

A layer's own config dataclass may keep a field named after a spec key (the value the role was
given) and may default it, but only to the spec's default by reference (`RolloutSpec.top_k`;
for a list key, the same values as a tuple), never by writing the value again: a default written twice drifts (it had: rollout's
max_sampling_rounds 1 against the spec's 4, the forward role's micro_batch_size 64 against 8).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from relax_hpc.spec import schema

PACKAGE = Path(schema.__file__).resolve().parents[1]

# Fields that share a name with a spec key but are another setting: (class, field) -> why.
OTHER_SETTINGS = {
    ("JobComponent", "name"): "a Slurm component's name, not [algorithm] name",
    ("Column", "dtype"): "a queue column's tensor dtype, not [model] dtype",
    ("RemoteRewardModel", "timeout_s"): "one HTTP request's timeout, split from [reward] timeout_s by the hub",
    ("ForwardConfig", "timeout_s"): "how long the forward role waits for rows, not a reward timeout",
    ("RolloutConfig", "device"): "the resolved device (cpu, cuda:N), not the spec's choice (auto)",
    ("ForwardConfig", "device"): "the resolved device, as above",
    ("ActorConfig", "device"): "the resolved device, as above",
    ("CriticConfig", "device"): "the resolved device, as above",
    ("CriticConfig", "timeout_s"): "how long the critic waits for a step's rows, not a reward timeout",
    ("Sample", "reward"): "a sample's reward, not the [reward] table",
    ("Sample", "advantage"): "a sample's advantage value, not the [algorithm] advantage estimator",
    ("EngineServers", "urls"): "a grow job's engine servers, not [notify] urls",
}


def spec_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Spec key -> (the schema class that declares it, its field)."""
    keys: dict[str, tuple[str, dataclasses.Field]] = {}
    for name, cls in vars(schema).items():
        if inspect.isclass(cls) and dataclasses.is_dataclass(cls) and cls.__module__ == schema.__name__:
            for f in dataclasses.fields(cls):
                keys.setdefault(f.name, (name, f))
    return keys


def restates(value: ast.expr, name: str, spec_field: dataclasses.Field) -> bool:
    """Whether a mirror's default expression writes the spec's default again."""
    if spec_field.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(spec_field.default_factory()):
        # A sub-table ([train.megatron]): a mirror holds None ("its defaults") or the spec's own
        # value; building a fresh one in the mirror states its defaults a second time.
        return isinstance(value, ast.Call)
    if spec_field.default_factory is not dataclasses.MISSING:
        # A list default is built per spec and has no class attribute to point at: the mirror
        # keeps it as a tuple, which must hold the same values.
        try:
            return tuple(ast.literal_eval(value)) != tuple(spec_field.default_factory())
        except ValueError:
            return True
    return not (isinstance(value, ast.Attribute) and value.attr == name
                and isinstance(value.value, ast.Name) and value.value.id.endswith("Spec"))


def is_dataclass_def(node: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(d) for d in node.decorator_list)


def restated_defaults(root: Path) -> list[str]:
    keys, found = spec_fields(), []
    for path in sorted(root.rglob("*.py")):
        if "spec" in path.relative_to(root).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ClassDef) and is_dataclass_def(node)):
                continue
            for item in node.body:
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value):
                    continue
                name = item.target.id
                if name not in keys or (node.name, name) in OTHER_SETTINGS:
                    continue
                table, spec_field = keys[name]
                if restates(item.value, name, spec_field):
                    found.append(f"{path.relative_to(root.parent)}:{item.lineno}: {node.name}.{name} = "
                                 f"{ast.unparse(item.value)} restates a spec default; write {table}.{name}")
    return found


def test_no_spec_default_is_declared_twice() -> None:
    found = restated_defaults(PACKAGE)
    assert not found, "\n".join(found)


def test_the_check_finds_a_restated_default(tmp_path: Path) -> None:
    (tmp_path / "layer.py").write_text(
        "from dataclasses import dataclass\n\n@dataclass\nclass Settings:\n"
        "    top_k: int = RolloutSpec.top_k\n    max_sampling_rounds: int = 1\n"
        "    stop: tuple[str, ...] = ()\n    adam_betas: tuple[float, float] = (0.9, 0.99)\n")
    assert restated_defaults(tmp_path) == [
        f"{tmp_path.name}/layer.py:6: Settings.max_sampling_rounds = 1 restates a spec default; "
        "write RolloutSpec.max_sampling_rounds",
        f"{tmp_path.name}/layer.py:8: Settings.adam_betas = (0.9, 0.99) restates a spec default; "
        "write TrainSpec.adam_betas"]


def test_the_references_hold_the_spec_values() -> None:
    from relax_hpc.engines.base import SamplingParams

    assert SamplingParams().max_new_tokens == schema.RolloutSpec.max_new_tokens == 64
