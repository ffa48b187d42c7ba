"""`check_exactly_once` and `relax-hpc inspect --check-exactly-once` on hand-built archives (two
trainer ranks, each archiving its share of a step), and after a tiny in-process run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import pytest

from relax_hpc.cli.main import main
from relax_hpc.data.sample import Sample, assign_sample_ids, make_sample_id
from relax_hpc.ops.archive import ArchiveError, HDF5TrajectoryArchive, archive_dir, read_archive, step_file
from relax_hpc.ops.exactly_once import check_exactly_once

REPO = Path(__file__).resolve().parents[2]
P, N = 3, 4  # prompts_per_step, n_samples_per_prompt of the hand-built jobs


def _spec_text(model: Path | str, job: Path, steps: int, prompts: int = P, n: int = N,
               rollout_extra: str = "", archive: bool = True) -> str:
    return f"""
[job]
name = "exactly-once"
output_dir = "{job}"
seed = 1

[model]
path = "{model}"

[data]
path = "{REPO / 'jobspecs' / 'data' / 'tiny_sum.jsonl'}"
max_prompt_tokens = 16

[rollout]
prompts_per_step = {prompts}
n_samples_per_prompt = {n}
max_new_tokens = 4
{rollout_extra}

[algorithm]
name = "grpo"

[reward]
function = "tiny_sum"

[train]
steps = {steps}
micro_batch_size = 256

[checkpoint]
save_interval = 100

[metrics]
tensorboard = false
plot = false
trajectory_archive = {str(archive).lower()}
"""


def _job(tmp_path: Path, steps: int = 4, rollout_extra: str = "") -> Path:
    job = tmp_path / "job"
    job.mkdir()
    (job / "spec.toml").write_text(_spec_text("unused-model", job, steps, rollout_extra=rollout_extra))
    return job


def _groups(step: int, sizes: list[int] | None = None, first_group: int = 0) -> list[list[Sample]]:
    """A step's groups as the rollout role makes them: group ids from a counter, one dataset row
    (and prompt) per group, sample ids by position."""
    groups = []
    for g, size in enumerate(sizes if sizes is not None else [N] * P):
        row = (step * P + g) % 25
        groups.append([Sample([row, 100], [m], [-0.5], weight_version=step, group_id=first_group + g,
                              prompt_index=row) for m in range(size)])
    assign_sample_ids(step, groups)
    return groups


def _archive(job: Path, step: int, samples: list[Sample], ranks: int = 2,
             writers: list[HDF5TrajectoryArchive] | None = None) -> None:
    """Rank r archives samples r, r + ranks, ...: a step's groups are split across the ranks."""
    writers = writers or [HDF5TrajectoryArchive(archive_dir(job), r, ranks) for r in range(ranks)]
    for r, writer in enumerate(writers):
        writer.append(step, samples[r::ranks])


def _flat(groups: list[list[Sample]]) -> list[Sample]:
    return [s for g in groups for s in g]


def _clean_job(tmp_path: Path, steps: int = 4) -> Path:
    job = _job(tmp_path, steps)
    writers = [HDF5TrajectoryArchive(archive_dir(job), r, 2) for r in range(2)]
    for step in range(steps):
        _archive(job, step, _flat(_groups(step, first_group=step * P)), writers=writers)
    return job


def test_a_clean_run_has_nothing_duplicated_or_lost(tmp_path: Path) -> None:
    report = check_exactly_once(_clean_job(tmp_path))
    assert report.steps == (0, 1, 2, 3) and report.samples == 4 * P * N
    assert report.problems == () and report.ok and report.rows_without_id == 0
    assert report.summary_line() == "exactly-once: 48 samples, 0 duplicated, 0 lost"
    assert "trainer rank(s) 0-1" in report.notes[0]
    assert "3 groups of 4 samples per step" in report.notes[1]


def test_a_resumed_run_that_redid_steps_is_clean(tmp_path: Path) -> None:
    # A crashed attempt archived steps 0-3; the checkpoint covers 0-1. The resumed run trains
    # steps 2-3 again with group ids restarting at 0: the archive replaces those step files.
    job = _clean_job(tmp_path)
    writers = [HDF5TrajectoryArchive(archive_dir(job), r, 2) for r in range(2)]
    for step in (2, 3):
        _archive(job, step, _flat(_groups(step, first_group=(step - 2) * P)), writers=writers)
    report = check_exactly_once(job)
    assert report.summary_line() == "exactly-once: 48 samples, 0 duplicated, 0 lost"


def test_a_sample_trained_twice_is_duplicated(tmp_path: Path) -> None:
    job = _job(tmp_path, steps=3)
    for step in range(3):
        samples = _flat(_groups(step))
        if step == 1:
            samples.append(samples[5])  # rank 1 got a row rank 0 also got (group 1, member 1)
        if step == 2:
            samples.append(_groups(0)[0][0])  # step 0's first sample trained again in step 2
        _archive(job, step, samples)
    report = check_exactly_once(job)
    assert (report.duplicated, report.lost) == (2, 0)
    assert [str(p) for p in report.problems] == [
        "step 1: 1 duplicated: sample s1-g1-m1 trained 2 times (ranks [0, 1])",
        "step 2: 1 duplicated: sample s0-g0-m0 (rank 0) belongs to step 0: a row trained in a step "
        "that is not its own",
    ]


def test_a_group_beyond_the_plan_and_a_repeated_group_are_duplicated(tmp_path: Path) -> None:
    job = _job(tmp_path, steps=1)
    groups = _groups(0)
    repeat = [Sample(list(s.prompt_ids), [9], [-0.5], 0, s.group_id, s.prompt_index) for s in groups[0]]
    assign_sample_ids(0, [*groups, repeat])  # the first group again, as a fourth position
    _archive(job, 0, _flat([*groups, repeat]))
    report = check_exactly_once(job)
    assert (report.duplicated, report.lost) == (N, 0)
    assert "group 3 is beyond the plan of 3 groups per step" in str(report.problems[0])


def test_a_missing_member_and_a_misplaced_answer_are_lost(tmp_path: Path) -> None:
    job = _job(tmp_path, steps=2)
    step0 = _groups(0)
    del step0[2][3]  # group 2 lost its member 3
    step1 = _groups(1)
    step1[0][2].prompt_ids = [24, 100]  # an answer to another prompt landed in group 0's slot
    _archive(job, 0, _flat(step0))
    _archive(job, 1, _flat(step1))
    report = check_exactly_once(job)
    assert (report.duplicated, report.lost) == (0, 2)
    assert str(report.problems[0]) == "step 0: 1 lost: group 2 lacks member(s) 3 of 4"
    assert "group 0: 1 of its 4 samples answer another prompt" in str(report.problems[1])
    assert report.summary_line() == "exactly-once: 23 samples, 0 duplicated, 2 lost"


def test_a_missing_step_and_a_missing_group_are_lost(tmp_path: Path) -> None:
    job = _job(tmp_path, steps=6)
    for step in (0, 1, 3):
        groups = _groups(step)
        _archive(job, step, _flat(groups[:2] if step == 3 else groups))
    report = check_exactly_once(job)
    # step 2 absent: 3 x 4 = 12 planned samples; step 3 lacks group 2: 4 samples.
    assert [str(p) for p in report.problems] == [
        "step 2: 12 lost: step 2 is not archived (3 x 4 samples planned)",
        "step 3: 4 lost: group(s) 2 missing, 4 samples each",
    ]
    # Steps 4-5 are not counted until the run says it trained them: summary.json, written at the
    # end of the run, after its last step file.
    summary = job / "summary.json"
    summary.write_text(json.dumps({"end_step": 6}))
    assert check_exactly_once(job).lost == 16 + 2 * 12
    os.utime(summary, (1, 1))  # an earlier run's summary: older than the archive, ignored
    assert check_exactly_once(job).lost == 16


def test_an_older_archive_without_sample_ids_is_checked_by_group(tmp_path: Path) -> None:
    job = _job(tmp_path, steps=2)
    for step in range(2):
        groups = _groups(step, first_group=step * P)
        for s in _flat(groups):
            s.sample_id = -1  # what an archive written before sample ids reads back as
        if step == 1:
            del groups[1][0]
        _archive(job, step, _flat(groups))
    for rank in range(2):  # and a file of format 1 really has no such column
        with h5py.File(step_file(archive_dir(job), rank, 0), "a") as f:
            del f["sample_id"]
            f.attrs["format_version"] = 1
    assert {r.sample_id for r in read_archive(job)[0]} == {-1}
    report = check_exactly_once(job)
    assert report.rows_without_id == 2 * P * N - 1
    assert any("no sample id" in note and "group id only" in note for note in report.notes)
    assert [str(p) for p in report.problems] == ["step 1: 1 lost: group id 4 has 3 samples, not 4"]


def test_dynamic_sampling_allows_short_steps_but_not_gaps(tmp_path: Path) -> None:
    job = _job(tmp_path, steps=2, rollout_extra="dynamic_sampling = true")
    _archive(job, 0, _flat(_groups(0, sizes=[N, N])))  # rounds ran out after 2 groups: allowed
    step1 = _groups(1)
    _archive(job, 1, _flat([step1[0], step1[2]]))  # group 1 of 3 is gone
    report = check_exactly_once(job)
    assert "dynamic sampling" in report.notes[1] and "not checked" in report.notes[1]
    assert [str(p) for p in report.problems] == ["step 1: 4 lost: group(s) 1 missing, 4 samples each"]


def test_agentic_groups_may_hold_any_number_of_samples(tmp_path: Path) -> None:
    job = _job(tmp_path, steps=1, rollout_extra='env = "relax_hpc.agents.examples.guess:GuessEnv"')
    groups = _groups(0, sizes=[7, 0, 2])  # sessions exported 7, none, and 2 samples
    for s in groups[0]:
        s.prompt_ids = [s.sample_id % 7]  # multi-turn samples of one group have different prompts
    del groups[0][4]
    _archive(job, 0, _flat(groups))
    report = check_exactly_once(job)
    assert "agentic" in report.notes[1]
    assert [str(p) for p in report.problems] == ["step 0: 1 lost: group 0 lacks member(s) 4 of 7"]


def test_no_archive_or_no_spec_is_unusable_input(tmp_path: Path) -> None:
    job = _job(tmp_path)
    with pytest.raises(ArchiveError, match=r"set \[metrics\] trajectory_archive = true"):
        check_exactly_once(job)
    (archive_dir(job) / "rank0").mkdir(parents=True)  # the directory alone is still no archive
    with pytest.raises(ArchiveError, match=r"trajectory_archive = true"):
        check_exactly_once(job)
    _archive(job, 0, _flat(_groups(0)))
    (job / "spec.toml").unlink()
    with pytest.raises(ArchiveError, match="spec.toml: the exactly-once check needs the spec"):
        check_exactly_once(job)


def test_cli_exit_codes_and_summary_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = _clean_job(tmp_path)
    assert main(["inspect", str(job), "--check-exactly-once"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "exactly-once: 48 samples, 0 duplicated, 0 lost"
    assert "problem" not in out

    groups = _groups(3, first_group=3 * P)  # the last step again, now with a row twice
    _archive(job, 3, [*_flat(groups), groups[0][0]])  # rank 0 trains s3-g0-m0 twice
    assert main(["inspect", str(job), "--check-exactly-once"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3:] == ["1 problem(s):", "  step 3: 1 duplicated: sample s3-g0-m0 trained 2 times (ranks [0, 0])",
                          "exactly-once: 49 samples, 1 duplicated, 0 lost"]

    assert main(["inspect", str(job), "--check-exactly-once", "--step", "1"]) == 2
    assert "drop --step and --samples" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["inspect", str(empty), "--check-exactly-once"]) == 2
    err = capsys.readouterr().err
    assert "set [metrics] trajectory_archive = true" in err


def test_cli_lists_at_most_20_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = _job(tmp_path, steps=30)
    for step in (0, 29):  # steps 1-28 missing: 28 problems
        _archive(job, step, _flat(_groups(step)))
    assert main(["inspect", str(job), "--check-exactly-once"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "28 problem(s):" in lines and "  ... and 8 more" in lines
    assert sum(line.startswith("  step ") for line in lines) == 20
    assert lines[-1] == f"exactly-once: {2 * P * N} samples, 0 duplicated, {28 * P * N} lost"


def test_a_tiny_in_process_run_trains_every_sample_once(tiny_model_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "run"
    spec = tmp_path / "spec.toml"
    spec.write_text(_spec_text(tiny_model_dir, job, steps=3, prompts=4, n=4))
    assert main(["run", str(spec), "--in-process", "--no-progress"]) == 0
    capsys.readouterr()

    report = check_exactly_once(job)
    assert report.rows_without_id == 0, "the rollout role did not set Sample.sample_id"
    assert report.summary_line() == "exactly-once: 48 samples, 0 duplicated, 0 lost"
    ids = {r.sample_id for rows in read_archive(job).values() for r in rows}
    assert ids == {make_sample_id(s, g, m) for s in range(3) for g in range(4) for m in range(4)}
    assert main(["inspect", str(job), "--check-exactly-once"]) == 0
