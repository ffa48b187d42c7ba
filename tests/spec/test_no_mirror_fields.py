"""The spec is the settings: no dataclass outside relax_hpc/spec/ repeats a spec key.

Roles, backends, engines and losses take the spec tables they read (or a narrow Protocol over them,
like `OptimSettings` over [train] and `LossSettings` over [algorithm]) and a small runtime context
(device, job dir, rank, threads, resolved paths). A dataclass with a field of the same name and
meaning as a spec key is a mirror: a second place where the setting lives, filled field by field and
free to drift from the spec. The walk below imports every module of relax_hpc/ outside spec/ and
compares each dataclass's fields with the keys of every table in schema.py; none is a mirror.

A field that only shares a word with a spec key (a tensor's `dtype`, a Slurm component's `name`)
goes in OTHER_MEANING with what it means instead. So do one engine call's sampling values
(`SamplingParams`): a chat request, a multi-turn episode's remaining budget, a generative judge or
an HTTP generate request sets them per call, and [rollout] fills them in one place only
(roles/rollout.py: sampling_of). The list is checked to hold only live entries, so it cannot rot.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import types
import typing
from dataclasses import dataclass

import relax_hpc
from relax_hpc.spec import schema

# A field that shares its name with a spec key but means something else: "Class.field" -> what.
OTHER_MEANING = {
    "ChatRequest.stop": "one chat request's stop strings, not [rollout] stop",
    # One engine call's sampling; [rollout] fills it only in roles/rollout.py: sampling_of, and its
    # defaults point at RolloutSpec's (test_single_defaults.py).
    "SamplingParams.max_new_tokens": "one engine call's token limit (a request's max_tokens, an episode's room)",
    "SamplingParams.temperature": "one engine call's temperature (a judge's, an HTTP request's)",
    "SamplingParams.top_p": "one engine call's top-p (an HTTP generate request's)",
    "SamplingParams.top_k": "one engine call's top-k (an HTTP generate request's)",
    "SamplingParams.stop": "one engine call's stop strings ([rollout] stop plus a chat request's)",
    "GenerateArgs.engine": "the batched engine a generate function calls, not [rollout] engine",
    "ToolCall.name": "a tool's name",
    "RootListing.steps": "the checkpoint steps found on disk",
    "Sample.advantage": "a sample's advantage value, not the [algorithm] advantage estimator",
    "_Attempt.stop": "the run's stop flag",
    "GenerateRequest.seed": "one HTTP generate request's sampling seed",
    "Fault.name": "a fault's name",
    "FaultJob.timeout_s": "the deadline of one fault's run",
    "FaultJob.env": "the environment of one fault's run",
    "GrowRequest.dtype": "the grow job's engines' dtype as submitted, rendered into its script",
    "GrowRequest.nodes": "the grow job's nodes, chosen from the engines it adds",
    "GrowRequest.cpus_per_node": "the grow job's, from the rollout component or [federation]",
    "GrowRequest.gpus_per_node": "the grow job's, from the engines it adds",
    "GrowRequest.time": "the grow job's limit: [federation] time, else the rollout component's",
    "GrowRequest.memory": "the grow job's, as above",
    "GrowRequest.partition": "the grow job's, as above",
    "GrowRequest.qos": "the grow job's, as above",
    "GrowRequest.account": "the grow job's, as above",
    "GrowRequest.constraint": "the grow job's, as above",
    "Action.urls": "engine servers' URLs, not [notify] urls",
    "EngineServers.env": "the environment of a grow node's engine servers",
    "EngineServers.urls": "a grow job's engine servers, not [notify] urls",
    "ImageEnv.python": "an interpreter inside a container image",
    "Machine.device": "the device the rehearsal found on this machine",
    "Machine.steps": "the rehearsal's step count, which replaces [train] steps in its spec",
    "Machine.arch": "the --arch flag of `relax-hpc rehearse`, which wins over [model] arch",
    "Rehearsal.arch": "the tiny model the rehearsal builds, resolved from --arch, [model] arch or config.json",
    "Component.name": "a rendered hetjob component's name",
    "JobComponent.nodes": "a Slurm component's node count as Slurm reports it",
    "JobComponent.name": "a Slurm component's name, not [algorithm] name",
    "PlaceholderIds.image": "the token id of an image placeholder",
    "TrajectoryRow.advantage": "an archived sample's advantage value",
    "ExactlyOnceReport.steps": "the steps found in the archive",
    "HealthEvent.time": "when a health event happened",
    "Panel.name": "a plot panel's name",
    "RemoteRewardModel.timeout_s": "one HTTP request's timeout, split from [reward] timeout_s by the hub",
    "MemoryRecord.device": "the device a role's bytes are on",
    "Batch.partition": "a transfer-queue partition",
    "PartitionInfo.name": "a transfer-queue partition's name",
    "Column.dtype": "a queue column's tensor dtype, not [model] dtype",
    "ArraySpec.dtype": "a decoded array's dtype",
    "_Flight.timeout_s": "the deadline of one queue request",
    "Header.backend": "the collective backend of a weight broadcast (gloo, nccl)",
    "ParamSlot.name": "a parameter's name",
    "ParamSlot.dtype": "a parameter's tensor dtype",
    # The resolved device (cpu, cuda:N) a role runs on: runtime context, not [train] device ("auto").
    "RolloutConfig.device": "the resolved device, runtime context",
    "ActorConfig.device": "the resolved device, runtime context",
    "CriticConfig.device": "the resolved device, runtime context",
    "ForwardConfig.device": "the resolved device, runtime context",
    "SGLangLaunch.device": "the resolved device, runtime context",
    "SGLangLaunch.model_path": "the policy's [model] path, not [critic] model_path",
    "ForwardConfig.timeout_s": "how long the forward role waits for rows, not a reward timeout",
    "CriticConfig.timeout_s": "how long the critic waits for a step's rows, not a reward timeout",
}


def _table_type(hint: object) -> bool:
    """Whether a spec field holds a whole sub-table (`sglang: SGLangSpec`, `critic: CriticSpec | None`):
    holding the table is the rule, not a copy of it."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) else (hint,)
    return any(inspect.isclass(a) and dataclasses.is_dataclass(a) and a.__module__ == schema.__name__ for a in args)


def spec_keys() -> dict[str, list[str]]:
    """Every spec key that holds a value (not a sub-table) -> the schema tables that declare it."""
    keys: dict[str, list[str]] = {}
    for name, cls in vars(schema).items():
        if inspect.isclass(cls) and dataclasses.is_dataclass(cls) and cls.__module__ == schema.__name__:
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                if not _table_type(hints[f.name]):
                    keys.setdefault(f.name, []).append(name)
    return keys


def package_dataclasses() -> list[type]:
    """Every dataclass defined in a module of relax_hpc/ outside relax_hpc/spec/ (each imported)."""
    found = []
    for info in pkgutil.walk_packages(relax_hpc.__path__, "relax_hpc."):
        if info.name == "relax_hpc.spec" or info.name.startswith("relax_hpc.spec."):
            continue
        module = importlib.import_module(info.name)
        found.extend(cls for cls in vars(module).values()
                     if inspect.isclass(cls) and dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__)
    return found


def repeated_fields(classes: list[type], keys: dict[str, list[str]]) -> dict[str, list[str]]:
    """Class name -> "field (SpecTable.field)" for each field named like a spec key, less OTHER_MEANING."""
    found: dict[str, list[str]] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.name in keys and f"{cls.__name__}.{f.name}" not in OTHER_MEANING:
                tables = ", ".join(f"{t}.{f.name}" for t in keys[f.name])
                found.setdefault(cls.__name__, []).append(f"{cls.__module__}.{cls.__name__}.{f.name} repeats {tables}")
    return found


def test_no_dataclass_repeats_a_spec_key() -> None:
    found = repeated_fields(package_dataclasses(), spec_keys())
    mirrors = [line for _, lines in sorted(found.items()) for line in lines]
    assert not mirrors, ("these dataclasses copy spec keys; take the spec table (or a Protocol over it) and a "
                         "runtime context instead, or, for a field that means something else, add it to "
                         "OTHER_MEANING with what it means:\n" + "\n".join(mirrors))


def test_other_meaning_holds_only_live_entries() -> None:
    classes, keys = package_dataclasses(), spec_keys()
    fields = {f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls)}
    stale = sorted(entry for entry in OTHER_MEANING if entry not in fields or entry.split(".")[1] not in keys)
    assert not stale, f"these fields no longer share a spec key's name: remove them from OTHER_MEANING: {stale}"


def test_the_walk_finds_a_mirror_and_passes_a_table() -> None:
    @dataclass
    class Settings:
        top_k: int  # [rollout] top_k again: a mirror
        sglang: schema.SGLangSpec  # the table itself: the rule
        rank: int  # runtime context

    keys = spec_keys()
    assert "sglang" not in keys and "data" not in keys and "top_k" in keys
    assert repeated_fields([Settings], keys) == {
        "Settings": [f"{__name__}.Settings.top_k repeats RolloutSpec.top_k"]}
    assert len(package_dataclasses()) > 100  # the walk reached the package's modules
