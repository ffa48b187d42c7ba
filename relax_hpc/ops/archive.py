"""The trajectory archive: every sample the trainer trained on, in HDF5, one file per step and rank.

Turned on by `[metrics] trajectory_archive = true`. Each trainer rank writes, after its optimizer
step, the samples it trained on to

    JOBDIR/trajectories/rank<r>/step_<step:06d>.h5

with one row per sample: prompt and response token ids and rollout log-probs (variable-length
arrays), the loss mask, reward, raw_reward, advantage, weight_version, group_id, prompt_index,
sample_id (the sample's slot in its step, relax_hpc.data.sample.make_sample_id), the step and the
rank. Files of format 1, written before sample ids, read back with sample_id -1. `step` is the rollout step (the queue partition `train_<step>`, counted
from 0; metrics.jsonl calls the same training step `step + 1`), so `step - weight_version` is the
sample's staleness: 0 for strictly on-policy samples, at most `max_staleness` otherwise.

Why a file per step and not one appendable file per rank: HDF5 is not crash-safe. A writer
killed with SIGKILL between two flushes of an appendable file left it unreadable ("addr
overflow") in about one run in fifteen in our tests, losing every earlier step with it. A step
file is written under a temporary name, fsynced and renamed, so a crash leaves either the whole
step or nothing, and earlier steps are never touched again.

Resuming: a crashed run may have archived steps its last checkpoint does not cover. Those steps
are trained again after the resume, so on the first append of a session the writer deletes its
step files from that step on (and leftover temporary files): the archive always describes the
training history of the weights the run continues from. A rewrite of the same (step, rank)
replaces the old file, so readers never see a row twice.

Read it with `read_archive(job_dir)`, or `relax-hpc inspect JOBDIR [--step N] [--samples K]`;
`relax-hpc inspect JOBDIR --check-exactly-once` checks it (relax_hpc.ops.exactly_once).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any, Callable, Iterable, Protocol, Sequence

from relax_hpc.ops.sample_ids import NO_SAMPLE_ID

ARCHIVE_DIRNAME = "trajectories"
_STEP_FILE = re.compile(r"^step_(\d+)\.h5$")
_RANK_DIR = re.compile(r"^rank(\d+)$")
_VLEN_FIELDS = {"prompt_ids": "int32", "response_ids": "int32",
                "rollout_log_probs": "float32", "loss_mask": "int8"}
_SCALAR_FIELDS = {"reward": "float32", "raw_reward": "float32", "advantage": "float32",
                  "weight_version": "int64", "group_id": "int64", "prompt_index": "int64",
                  "sample_id": "int64"}
# Columns added after format 1, and the value a file without them reads back as.
_ADDED_FIELDS = {"sample_id": NO_SAMPLE_ID}
FORMAT_VERSION = 2  # 2: the sample_id column


class ArchiveError(ValueError):
    """The archive is missing or a file of it cannot be read; the message says what to do."""


class ArchivableSample(Protocol):
    """What the archive needs from a trained sample (relax_hpc.data.sample.Sample has it)."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    weight_version: int
    group_id: int
    prompt_index: int
    sample_id: int
    reward: float
    raw_reward: float
    advantage: float

    def mask(self) -> list[int]: ...


@dataclass(frozen=True)
class TrajectoryRow:
    """One archived sample as read back."""

    step: int
    rank: int
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    loss_mask: list[int]
    reward: float
    raw_reward: float
    advantage: float
    weight_version: int
    group_id: int
    prompt_index: int
    sample_id: int = NO_SAMPLE_ID  # NO_SAMPLE_ID: not assigned, or a format 1 file

    @property
    def staleness(self) -> int:
        return self.step - self.weight_version


class TrajectoryArchive(Protocol):
    """Where the trainer puts the samples of each step once it has trained on them."""

    def append(self, step: int, samples: Sequence[ArchivableSample]) -> None: ...
    def close(self) -> None: ...


def archive_dir(job_dir: Path) -> Path:
    return Path(job_dir) / ARCHIVE_DIRNAME


def step_file(root: Path, rank: int, step: int) -> Path:
    return Path(root) / f"rank{rank}" / f"step_{step:06d}.h5"


def to_row(step: int, rank: int, s: ArchivableSample) -> TrajectoryRow:
    return TrajectoryRow(
        step=step, rank=rank, prompt_ids=[int(x) for x in s.prompt_ids],
        response_ids=[int(x) for x in s.response_ids],
        rollout_log_probs=[float(x) for x in s.rollout_log_probs],
        loss_mask=[int(x) for x in s.mask()], reward=float(s.reward),
        raw_reward=float(s.raw_reward), advantage=float(s.advantage),
        weight_version=int(s.weight_version), group_id=int(s.group_id),
        prompt_index=int(s.prompt_index), sample_id=int(s.sample_id),
    )


class InMemoryTrajectoryArchive:
    """The same contract kept in a dict (tests): a session's first append drops steps >= it."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.steps: dict[int, list[TrajectoryRow]] = {}
        self._started = False

    def append(self, step: int, samples: Sequence[ArchivableSample]) -> None:
        if not self._started:
            self._started = True
            self.steps = {s: rows for s, rows in self.steps.items() if s < step}
        self.steps[step] = [to_row(step, self.rank, s) for s in samples]

    def restart(self) -> None:
        """What a new process sees: the stored steps, and a new session."""
        self._started = False

    def close(self) -> None:
        pass


class HDF5TrajectoryArchive:
    """Rank `rank`'s step files under `root` (JOBDIR/trajectories); ranks never share a file.

    Rank 0 also prunes the directories of ranks >= world_size, left by an earlier run that had
    more trainer ranks, so a smaller resumed run does not leave their later steps behind.
    """

    def __init__(self, root: Path, rank: int = 0, world_size: int = 1) -> None:
        self.root, self.rank, self.world_size = Path(root), rank, world_size
        self._dir = self.root / f"rank{rank}"
        self._started = False

    def append(self, step: int, samples: Sequence[ArchivableSample]) -> None:
        if not self._started:
            self._start_session(step)
        rows = [to_row(step, self.rank, s) for s in samples]
        final = step_file(self.root, self.rank, step)
        tmp = final.with_name(final.name + ".tmp")
        _write_rows(tmp, rows, step, self.rank)
        os.replace(tmp, final)  # a reader sees the whole step or none of it
        _fsync_dir(self._dir)

    def close(self) -> None:
        pass

    def _start_session(self, first_step: int) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        dirs = [self._dir]
        if self.rank == 0:
            dirs += [d for r, d in _rank_dirs(self.root) if r >= self.world_size]
        for d in dirs:
            prune_from(d, first_step)
        self._started = True


def prune_from(rank_dir: Path, first_step: int) -> list[Path]:
    """Delete step files of steps >= first_step and temporary files; the deleted paths."""
    removed = []
    for path in sorted(rank_dir.iterdir()) if rank_dir.is_dir() else []:
        m = _STEP_FILE.match(path.name)
        if path.name.endswith(".tmp") or (m and int(m.group(1)) >= first_step):
            path.unlink()
            removed.append(path)
    return removed


def _write_rows(path: Path, rows: list[TrajectoryRow], step: int, rank: int) -> None:
    import h5py
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.attrs.update({"format_version": FORMAT_VERSION, "step": step, "rank": rank,
                        "rows": len(rows)})
        n = len(rows)
        for name, dtype in _VLEN_FIELDS.items():
            data = np.empty(n, dtype=object)
            for i, r in enumerate(rows):
                data[i] = np.asarray(getattr(r, name), dtype=dtype)
            f.create_dataset(name, data=data, dtype=h5py.vlen_dtype(np.dtype(dtype)))
        for name, dtype in _SCALAR_FIELDS.items():
            f.create_dataset(name, data=np.asarray([getattr(r, name) for r in rows], dtype=dtype))
        f.flush()
        os.fsync(f.id.get_vfd_handle())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rank_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := _RANK_DIR.match(p.name))]
    return sorted(found)


def step_files(root: Path) -> dict[int, list[Path]]:
    """step -> its files (one per rank), for every complete step file under `root`."""
    by_step: dict[int, list[Path]] = {}
    for _rank, d in _rank_dirs(root):
        for path in sorted(d.iterdir()):
            m = _STEP_FILE.match(path.name)
            if m:
                by_step.setdefault(int(m.group(1)), []).append(path)
    return dict(sorted(by_step.items()))


def read_columns(path: Path, names: Sequence[str]) -> tuple[int, int, dict[str, Any]]:
    """(step, rank, name -> numpy column) of one step file, reading only the named columns.

    A column added after format 1 (sample_id) that an older file lacks comes back filled with
    its default (NO_SAMPLE_ID). ArchiveError if it is not a readable archive file.
    """
    import h5py
    import numpy as np

    try:
        with h5py.File(path, "r", locking=False) as f:
            step, rank, rows = int(f.attrs["step"]), int(f.attrs["rank"]), int(f.attrs["rows"])
            cols: dict[str, Any] = {
                n: f[n][()] if n in f or n not in _ADDED_FIELDS
                else np.full(rows, _ADDED_FIELDS[n], dtype=_SCALAR_FIELDS[n])
                for n in names
            }
    except (OSError, KeyError) as e:
        raise ArchiveError(
            f"cannot read trajectory archive file {path} ({e}); it is not a complete archive "
            "step file: delete it (only that step is lost) or move it out of the archive"
        ) from e
    return step, rank, cols


def read_step_file(path: Path) -> list[TrajectoryRow]:
    """The rows of one step file; ArchiveError if it is not a readable archive file."""
    step, rank, cols = read_columns(path, (*_VLEN_FIELDS, *_SCALAR_FIELDS))
    return [
        TrajectoryRow(
            step=step, rank=rank,
            prompt_ids=cols["prompt_ids"][i].tolist(), response_ids=cols["response_ids"][i].tolist(),
            rollout_log_probs=cols["rollout_log_probs"][i].tolist(),
            loss_mask=cols["loss_mask"][i].tolist(), reward=float(cols["reward"][i]),
            raw_reward=float(cols["raw_reward"][i]), advantage=float(cols["advantage"][i]),
            weight_version=int(cols["weight_version"][i]), group_id=int(cols["group_id"][i]),
            prompt_index=int(cols["prompt_index"][i]), sample_id=int(cols["sample_id"][i]),
        )
        for i in range(len(cols["reward"]))
    ]


def read_archive(job_dir: Path, steps: Iterable[int] | None = None) -> dict[int, list[TrajectoryRow]]:
    """step -> rows (all ranks, rank order) for the job's archive, or only the given steps.

    ArchiveError when the job has no archive or a requested step is not in it.
    """
    root = archive_dir(job_dir)
    files = step_files(root)
    if not files:
        raise ArchiveError(
            f"no trajectory archive in {job_dir} (looked for {root}/rank<r>/step_*.h5); set "
            "[metrics] trajectory_archive = true in the job spec and run the job"
        )
    wanted = sorted(files) if steps is None else sorted(set(steps))
    missing = [s for s in wanted if s not in files]
    if missing:
        raise ArchiveError(
            f"step {missing[0]} is not in the trajectory archive of {job_dir}; archived steps: "
            f"{format_ranges(sorted(files))}"
        )
    return {s: [row for path in files[s] for row in read_step_file(path)] for s in wanted}


@dataclass(frozen=True)
class StepSummary:
    step: int
    rows: int
    ranks: int
    mean_reward: float
    mean_raw_reward: float
    mean_response_length: float
    weight_versions: tuple[int, ...]
    staleness_min: int
    staleness_mean: float
    staleness_max: int


def summarize_step(step: int, rows: Sequence[TrajectoryRow]) -> StepSummary:
    if not rows:
        return StepSummary(step, 0, 0, 0.0, 0.0, 0.0, (), 0, 0.0, 0)
    stale = [r.staleness for r in rows]
    return StepSummary(
        step=step, rows=len(rows), ranks=len({r.rank for r in rows}),
        mean_reward=mean(r.reward for r in rows), mean_raw_reward=mean(r.raw_reward for r in rows),
        mean_response_length=mean(len(r.response_ids) for r in rows),
        weight_versions=tuple(sorted({r.weight_version for r in rows})),
        staleness_min=min(stale), staleness_mean=mean(stale), staleness_max=max(stale),
    )


def format_summaries(summaries: Sequence[StepSummary]) -> str:
    """One line per step, the step counted as metrics.jsonl and `relax-hpc status` count it (from 1:
    the archive's step + 1)."""
    header = (f"{'step':>6} {'rows':>6} {'ranks':>5} {'reward':>8} {'raw':>8} {'resp_len':>8}  "
              f"{'versions':<12} staleness min/mean/max")
    lines = [header]
    for s in summaries:
        versions = ",".join(str(v) for v in s.weight_versions)
        lines.append(
            f"{s.step + 1:>6} {s.rows:>6} {s.ranks:>5} {s.mean_reward:>8.3f} {s.mean_raw_reward:>8.3f} "
            f"{s.mean_response_length:>8.2f}  {versions:<12} "
            f"{s.staleness_min}/{s.staleness_mean:.2f}/{s.staleness_max}"
        )
    return "\n".join(lines)


def format_samples(rows: Sequence[TrajectoryRow], decode: Callable[[list[int]], str] | None) -> str:
    """Example samples, decoded with `decode` when given, else as token ids."""

    def show(ids: list[int]) -> str:
        return repr(decode(ids)) if decode is not None else f"token ids {ids}"

    lines = []
    for r in rows:
        lines += [
            f"[step {r.step + 1} rank {r.rank} group {r.group_id} prompt {r.prompt_index} "
            f"v{r.weight_version}] reward {r.reward:.3f} (raw {r.raw_reward:.3f}) "
            f"advantage {r.advantage:+.3f}, {len(r.response_ids)} response tokens "
            f"({sum(r.loss_mask)} trained)",
            f"  prompt:   {show(r.prompt_ids)}",
            f"  response: {show(r.response_ids)}",
        ]
    return "\n".join(lines)


def inspect_report(job_dir: Path, step: int | None = None, samples: int = 0,
                   decode: Callable[[list[int]], str] | None = None) -> str:
    """What `relax-hpc inspect` prints: per-step summaries (all steps, or `step`), then `samples`
    example rows of `step` (default: the last archived step). Steps are counted as metrics.jsonl and
    `relax-hpc status` count them, from 1: ``step`` N is the archive's step N - 1."""
    if step is not None:
        archived = sorted(step_files(archive_dir(job_dir)))
        if step < 1 or (archived and step - 1 not in archived):
            raise ArchiveError(f"step {step} is not in the trajectory archive of {job_dir}; archived steps "
                               f"(counted from 1, as in metrics.jsonl): {format_ranges([s + 1 for s in archived])}")
    by_step = read_archive(job_dir, None if step is None else [step - 1])
    summaries = [summarize_step(s, rows) for s, rows in by_step.items()]
    total = sum(s.rows for s in summaries)
    out = [f"trajectory archive {archive_dir(job_dir)}: {len(summaries)} step(s) "
           f"({format_ranges([s + 1 for s in sorted(by_step)])}), {total} rows; step = training step as in "
           "metrics.jsonl and `relax-hpc status` (its file is step_<step - 1>.h5), staleness = step - 1 - "
           "weight_version",
           format_summaries(summaries)]
    if samples > 0:
        shown = step - 1 if step is not None else max(by_step)
        out += ["", f"{min(samples, len(by_step[shown]))} example sample(s) of step {shown + 1}:",
                format_samples(by_step[shown][:samples], decode)]
    return "\n".join(out)


def format_ranges(steps: list[int]) -> str:
    """[0,1,2,5,6] -> '0-2, 5-6'."""
    parts, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            parts.append(str(start) if start == s else f"{start}-{s}")
            start = None
    return ", ".join(parts)
