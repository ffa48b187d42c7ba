"""Was every sample the job planned trained exactly once? A check of the trajectory archive.

`relax-hpc inspect JOBDIR --check-exactly-once` runs `check_exactly_once(JOBDIR)`. It reads the
archive of every trainer rank (relax_hpc.ops.archive; each rank archives the share of a step's
rows it trained, so a step is the union of its rank files) and the job's spec.toml, which says
what a step should hold: `[rollout] prompts_per_step` groups of `n_samples_per_prompt` samples.

Every sample carries a sample id, its slot in its step: (step, group position, member)
(relax_hpc.data.sample.make_sample_id, set by the rollout role once a step's groups are final).
Rollout engines may join and leave while the job runs and a dead engine's prompts are re-issued
to others, so the check is about slots, not engines:

- duplicated: a slot trained more than once (in one step or two), a sample archived in a step
  that is not its own, a slot beyond the plan (a group position >= prompts_per_step, a member
  >= n_samples_per_prompt), the same group (group id, dataset row) in two positions;
- lost: a planned slot no step trained, a member whose prompt differs from its group's (the
  slot holds an answer to another prompt), a step missing between the first and the last
  archived step (or before the end_step of summary.json: the run said it trained it).

With `[rollout] dynamic_sampling` a step may end with fewer groups (rounds ran out), so only the
groups it has are checked, and that they are numbered 0.. without gaps. Agentic runs export any
number of samples per group (or none), so members are checked to be numbered without gaps and
positions to be < prompts_per_step; a group with no samples is not an error. Archive files
written before sample ids (format 1) are checked by group id: group sizes and counts only.
`ExactlyOnceReport.notes` says which of these applied.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

from relax_hpc.ops.sample_ids import NO_SAMPLE_ID, format_sample_id, make_sample_id, split_sample_id
from relax_hpc.ops.archive import ArchiveError, archive_dir, format_ranges, read_columns, step_files
from relax_hpc.spec.schema import JobSpec, RolloutSpec

Kind = Literal["duplicated", "lost"]


@dataclass(frozen=True)
class StepPlan:
    """What one step should train: the job's [rollout] table, as its spec.toml has it."""

    rollout: RolloutSpec

    @property
    def agentic(self) -> bool:
        """An env, a custom generate or an agent: a group holds what its sessions exported."""
        r = self.rollout
        return bool(r.env or r.generate or r.agent)

    @property
    def planned_samples(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt

    def describe(self) -> str:
        p, n = self.rollout.prompts_per_step, self.rollout.n_samples_per_prompt
        if self.agentic:
            return (f"agentic: up to {p} groups per step, each the samples its {n} sessions exported "
                    "(any number); checked: ids once, members numbered without gaps, positions < "
                    f"{p}; not checked: how many samples a group should have")
        if self.rollout.dynamic_sampling:
            return (f"dynamic sampling: up to {p} groups of {n} per step; checked: ids once, groups "
                    "numbered from 0 without gaps, each whole; not checked: whether a short step "
                    "should have found more groups")
        return f"{p} groups of {n} samples per step, each slot exactly once"


@dataclass(frozen=True)
class Problem:
    step: int
    kind: Kind
    count: int  # samples
    detail: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.count} {self.kind}: {self.detail}"


@dataclass(frozen=True)
class ExactlyOnceReport:
    job_dir: Path
    plan: StepPlan
    steps: tuple[int, ...]  # archived steps
    samples: int  # archived rows, all steps and ranks
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()  # what was checked and how
    rows_without_id: int = 0  # rows checked by group id only (format 1 files, or ids never set)

    @property
    def duplicated(self) -> int:
        return sum(p.count for p in self.problems if p.kind == "duplicated")

    @property
    def lost(self) -> int:
        return sum(p.count for p in self.problems if p.kind == "lost")

    @property
    def ok(self) -> bool:
        return self.duplicated == 0 and self.lost == 0

    def summary_line(self) -> str:
        return f"exactly-once: {self.samples} samples, {self.duplicated} duplicated, {self.lost} lost"

    def format(self, max_problems: int = 20) -> str:
        """What the CLI prints: notes, the first `max_problems` problems, the summary line last."""
        lines = list(self.notes)
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s):")
            lines += [f"  {p}" for p in self.problems[:max_problems]]
            if len(self.problems) > max_problems:
                lines.append(f"  ... and {len(self.problems) - max_problems} more")
        lines.append(self.summary_line())
        return "\n".join(lines)


class _Row(NamedTuple):
    rank: int
    group_id: int
    prompt_index: int
    sample_id: int
    prompt: bytes  # the prompt's token ids (b"" for agentic runs: their members' prompts differ)


@dataclass
class _StepCheck:
    """The problems of one step, collected as the step is read."""

    step: int
    plan: StepPlan
    problems: list[Problem] = field(default_factory=list)

    def add(self, kind: Kind, count: int, detail: str) -> None:
        if count > 0:
            self.problems.append(Problem(self.step, kind, count, detail))


def check_exactly_once(job_dir: Path) -> ExactlyOnceReport:
    """Check JOBDIR's trajectory archive against its spec.toml; ArchiveError on unusable input."""
    job_dir = Path(job_dir)
    files = step_files(archive_dir(job_dir))
    if not files:
        raise ArchiveError(
            f"no trajectory archive in {job_dir} (looked for {archive_dir(job_dir)}/rank<r>/step_*.h5): "
            "the exactly-once check reads the samples each step trained; set [metrics] "
            "trajectory_archive = true in the job spec and run the job (it archives from its next step)")
    plan = StepPlan(_load_job_spec(job_dir).rollout)
    steps = sorted(files)
    problems: list[Problem] = []
    samples = without_id = 0
    ranks: set[int] = set()
    for step in steps:
        rows = _read_step(files[step], with_prompt=not plan.agentic)
        samples += len(rows)
        ranks |= {r.rank for r in rows}
        check = _StepCheck(step, plan)
        if any(r.sample_id == NO_SAMPLE_ID for r in rows):
            without_id += len(rows)
            _check_by_group_id(check, rows)
        else:
            _check_by_sample_id(check, rows)
        problems += check.problems
    problems += _missing_steps(job_dir, files, plan)
    problems.sort(key=lambda p: p.step)
    notes = [f"trajectory archive {archive_dir(job_dir)}: {len(steps)} step(s) ({format_ranges(steps)}), "
             f"{samples} samples, trainer rank(s) {format_ranges(sorted(ranks))}",
             f"plan ({job_dir / 'spec.toml'}): {plan.describe()}"]
    if without_id:
        notes.append(f"{without_id} sample(s) have no sample id (archive files written before sample "
                     "ids, format 1, or a rollout that did not set them): their steps are checked by "
                     "group id only (group sizes and counts)")
    if steps[0] > 0:
        notes.append(f"step(s) {format_ranges(list(range(steps[0])))} are not archived (the archive "
                     f"starts at step {steps[0]}): not checked")
    return ExactlyOnceReport(job_dir, plan, tuple(steps), samples, tuple(problems), tuple(notes), without_id)


def _load_job_spec(job_dir: Path) -> JobSpec:
    from relax_hpc.spec import SpecError, load_spec

    path = job_dir / "spec.toml"
    if not path.is_file():
        raise ArchiveError(f"no {path}: the exactly-once check needs the spec the run used (it says what a "
                           "step holds); pass the job's output directory, where `relax-hpc run` writes it")
    try:
        return load_spec(path)
    except SpecError as e:
        raise ArchiveError(f"cannot read the job's spec {path}: {e}") from e


def _read_step(paths: list[Path], with_prompt: bool) -> list[_Row]:
    names = ("group_id", "prompt_index", "sample_id", *(("prompt_ids",) if with_prompt else ()))
    rows = []
    for path in paths:
        _, rank, cols = read_columns(path, names)
        for i in range(len(cols["group_id"])):
            prompt = cols["prompt_ids"][i].tobytes() if with_prompt else b""
            rows.append(_Row(rank, int(cols["group_id"][i]), int(cols["prompt_index"][i]),
                             int(cols["sample_id"][i]), prompt))
    return rows


def _check_by_sample_id(check: _StepCheck, rows: list[_Row]) -> None:
    step, plan = check.step, check.plan
    slots: dict[tuple[int, int], list[_Row]] = defaultdict(list)
    for r in rows:
        s, g, m = split_sample_id(r.sample_id)
        if s != step:
            check.add("duplicated", 1, f"sample {format_sample_id(r.sample_id)} (rank {r.rank}) belongs "
                                       f"to step {s}: a row trained in a step that is not its own")
        else:
            slots[(g, m)].append(r)
    for (g, m), rs in sorted(slots.items()):
        if len(rs) > 1:
            check.add("duplicated", len(rs) - 1, f"sample {format_sample_id(make_sample_id(step, g, m))} "
                                                 f"trained {len(rs)} times (ranks {sorted(r.rank for r in rs)})")
    groups: dict[int, dict[int, _Row]] = defaultdict(dict)
    for (g, m), rs in slots.items():
        groups[g][m] = rs[0]
    n, p = plan.rollout.n_samples_per_prompt, plan.rollout.prompts_per_step
    for g in sorted(groups):
        members = groups[g]
        if g >= p:
            check.add("duplicated", len(members), f"group {g} is beyond the plan of {p} groups per step")
            continue
        extra = sorted(m for m in members if m >= n and not plan.agentic)
        check.add("duplicated", len(extra), f"group {g} has members {format_ranges(extra)}, beyond its {n}")
        want = range(n) if not plan.agentic else range(max(members) + 1)
        missing = [m for m in want if m not in members]
        check.add("lost", len(missing), f"group {g} lacks member(s) {format_ranges(missing)} of {len(want)}")
        _check_group_agrees(check, f"group {g}", list(members.values()))
    if not plan.agentic:
        last = p - 1 if not plan.rollout.dynamic_sampling else max((g for g in groups if g < p), default=-1)
        absent = [g for g in range(last + 1) if g not in groups]
        check.add("lost", len(absent) * n, f"group(s) {format_ranges(absent)} missing, {n} samples each")
    _check_groups_distinct(check, {g: list(ms.values()) for g, ms in groups.items() if g < p})


def _check_group_agrees(check: _StepCheck, name: str, members: list[_Row]) -> None:
    """Members of one group answer one prompt: one group id, dataset row and prompt."""
    keys = Counter((r.group_id, r.prompt_index, r.prompt) for r in members)
    if len(keys) > 1:
        (gid, index, _), _count = keys.most_common(1)[0]
        odd = len(members) - keys.most_common(1)[0][1]
        check.add("lost", odd, f"{name}: {odd} of its {len(members)} samples answer another prompt than "
                               f"the rest (group id {gid}, dataset row {index}): their slots hold no answer "
                               "to the group's prompt")


def _check_groups_distinct(check: _StepCheck, groups: dict[int, list[_Row]]) -> None:
    """One group (group id, dataset row) fills one position of a step, never two."""
    seen: dict[tuple[int, int], int] = {}
    for g in sorted(groups):
        if not groups[g]:
            continue
        key = Counter((r.group_id, r.prompt_index) for r in groups[g]).most_common(1)[0][0]
        if key in seen:
            check.add("duplicated", len(groups[g]), f"group {g} repeats group {seen[key]} (group id "
                                                    f"{key[0]}, dataset row {key[1]})")
        else:
            seen[key] = g


def _check_by_group_id(check: _StepCheck, rows: list[_Row]) -> None:
    """Rows without sample ids: group sizes against the plan, and the number of groups."""
    plan = check.plan
    n, p = plan.rollout.n_samples_per_prompt, plan.rollout.prompts_per_step
    groups: dict[int, list[_Row]] = defaultdict(list)
    for r in rows:
        groups[r.group_id].append(r)
    for gid in sorted(groups):
        members = groups[gid]
        if not plan.agentic:
            check.add("duplicated", len(members) - n, f"group id {gid} has {len(members)} samples, not {n}")
            check.add("lost", n - len(members), f"group id {gid} has {len(members)} samples, not {n}")
        _check_group_agrees(check, f"group id {gid}", members)
    if len(groups) > p:
        extra = len(groups) - p
        count = extra * n if not plan.agentic else extra
        check.add("duplicated", count, f"{len(groups)} groups, beyond the plan of {p} per step")
    elif len(groups) < p and not (plan.agentic or plan.rollout.dynamic_sampling):
        check.add("lost", (p - len(groups)) * n, f"{len(groups)} groups of the {p} planned")


def _missing_steps(job_dir: Path, files: dict[int, list[Path]], plan: StepPlan) -> list[Problem]:
    """Steps between the first and the last archived one, and up to summary.json's end_step."""
    steps = sorted(files)
    end = max(steps[-1] + 1, _finished_end_step(job_dir, files) or 0)
    have = set(steps)
    unit = "samples" if not plan.agentic else "sessions"
    p, n = plan.rollout.prompts_per_step, plan.rollout.n_samples_per_prompt
    return [Problem(s, "lost", plan.planned_samples, f"step {s} is not archived ({p} x {n} {unit} planned)")
            for s in range(steps[0], end) if s not in have]


def _finished_end_step(job_dir: Path, files: dict[int, list[Path]]) -> int | None:
    """The end_step of the run that wrote the archive's last files, if it finished: its summary.json,
    written at the end of a run, is newer than every step file (an older one is an earlier run's)."""
    summary = job_dir / "summary.json"
    try:
        newest = max(path.stat().st_mtime for paths in files.values() for path in paths)
        if summary.stat().st_mtime < newest:
            return None
        return int(json.loads(summary.read_text())["end_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no finished run to compare with: the archive's own range is all there is
