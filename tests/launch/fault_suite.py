"""`relax-hpc faults` on a small copy of the embedded tiny spec, on CPU: every fault is injected
into a real run, and each run must recover with every planned sample trained exactly once.

The faults run in groups (`GROUPS`), one test module each (tests/launch/test_faults_<group>.py):
each module runs `relax-hpc faults --only <its faults> --in-one-run` once (the group's faults one
after another in one run of the spec; disk-full in a run of its own), and its tests check one row
of its faults.json each, then the printed table, the last line and the exit status, and that
nothing was left behind. Two faults a run: one start-up for both, each module's run inside the
per-test budget (docs/testing.md), and two test workers run the groups side by side.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.jobspecs import embedded_dir, with_embedded_inputs
from relax_hpc.faults.fault import REPORT
from relax_hpc.spec import load_spec, spec_to_toml


REPO = Path(__file__).resolve().parents[2]
STEPS, PROMPTS, SAMPLES = 8, 4, 8
RUN_TIMEOUT_S = 240

# The restart each fault should cost (docs/operations.md, "Health"): a role that is not core is
# restarted in place, a core role (ActorFwd, a trainer rank) costs a restart of the whole run.
# A dead engine stops nothing (the router gives its prompts to the other engine); the driver
# looks at the engines after every step and starts a replacement.
RESTART: dict[str, tuple[str, ...]] = {
    "kill-engine": ("in place",),
    "kill-actor-fwd": ("global",),
    "kill-reference": ("in place",),
    "kill-reference-3x": ("global",),
    "kill-trainer-rank": ("global",),
    "kill-critic": ("global",),
    "kill-driver": ("rerun",),
    "hang-reference": ("in place",),
    "corrupt-checkpoint": ("rerun",),
    "disk-full": ("none",),
}


@dataclasses.dataclass(frozen=True)
class SuiteResult:
    returncode: int
    stdout: str
    rows: dict[str, dict[str, Any]]
    out: Path
    faults: tuple[str, ...]


# In the order of relax_hpc/faults/chain.py's ONE_RUN_ORDER (the order the table shows).
# On a quiet 2-core machine (2026-11-28) four faults in one run took 115 s (the in-place ones) and
# 146 s (the global ones and the reruns), against about 75 s for each fault in a run of its own.
GROUPS: dict[str, tuple[str, ...]] = {
    "three_kills": ("kill-reference-3x", "kill-engine"),
    "in_place": ("kill-reference", "hang-reference", "kill-critic"),
    "global": ("kill-actor-fwd", "kill-trainer-rank"),
    "rerun": ("kill-driver", "corrupt-checkpoint"),
    "disk_full": ("disk-full",),
}


def run_group(base: Path, model_dir: Path, group: str) -> SuiteResult:
    """`relax-hpc faults --only <the group's faults>` on the tiny spec, in `base`."""
    path = embedded_dir() / "tiny_local.toml"
    spec = with_embedded_inputs(load_spec(path), path)
    spec = dataclasses.replace(
        spec, job=dataclasses.replace(spec.job, name="tiny_faults"),
        model=dataclasses.replace(spec.model, path=str(model_dir)),
        rollout=dataclasses.replace(spec.rollout, prompts_per_step=PROMPTS, n_samples_per_prompt=SAMPLES))
    spec_path = base / "tiny_faults.toml"
    spec_path.write_text(spec_to_toml(spec))
    out = base / "out"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-m", "relax_hpc.cli.main", "faults", str(spec_path), "--out", str(out),
                           "--steps", str(STEPS), "--run-timeout-s", str(RUN_TIMEOUT_S), "--in-one-run",
                           "--only", *GROUPS[group]],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
    print(done.stdout, done.stderr, sep="\n")  # the table, in the test's output when one fails
    report = json.loads((out / REPORT).read_text())
    return SuiteResult(done.returncode, done.stdout, {row["fault"]: row for row in report["rows"]}, out,
                       GROUPS[group])


def check_fault_recovered_with_every_sample_trained_once(suite: SuiteResult, fault: str) -> None:
    row = suite.rows[fault]
    if fault == "disk-full" and os.geteuid() != 0:
        pytest.skip("needs root to mount a small file system")
    assert row["ran"] and row["recovered"], row["note"]
    assert (row["duplicated"], row["lost"]) == (0, 0)
    assert row["run_steps"] >= STEPS and row["samples"] == row["run_steps"] * PROMPTS * SAMPLES
    assert row["restart"] in RESTART[fault], row["note"]
    assert row["recover_s"] is not None and row["recover_s"] >= 0


def check_table_last_line_and_exit_0(suite: SuiteResult) -> None:
    lines = suite.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("fault ") and "recovered" in line)
    assert [line.split()[0] for line in lines[header + 1: header + 1 + len(suite.faults)]] == list(suite.faults)
    skipped = 0 if os.geteuid() == 0 else sum(1 for f in suite.faults if f == "disk-full")
    not_run = f" ({skipped} not run)" if skipped else ""
    ran = len(suite.faults) - skipped
    assert lines[-1] == f"faults survived: {ran}/{ran}{not_run}, samples lost 0, duplicated 0"
    assert suite.returncode == 0


def check_no_process_and_no_mount_left(suite: SuiteResult) -> None:
    # Every process of a run names its job directory: the driver in its command line, the Ray
    # processes and workers in RELAX_HPC_SECRET_FILE (a local run's secret is JOBDIR/.secret).
    marker = str(suite.out).encode()
    left = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            seen = Path(entry.path, "cmdline").read_bytes() + Path(entry.path, "environ").read_bytes()
            state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in seen and state != "Z":
            left.append((entry.name, state, Path(entry.path, "cmdline").read_bytes()[:80]))
    assert left == []
    assert not os.path.ismount(suite.out / "disk-full" / "checkpoints")


def check_a_role_killed_three_times_in_a_row_restarts_the_whole_run(suite: SuiteResult) -> None:
    """Twice in place, the third failure of the same role a global restart (max_in_place_restarts
    = 3); each is a health event, counted in the step metrics too. The run goes on to the group's
    next fault (a killed engine: one more restart in place)."""
    job_dir = Path(suite.rows["kill-reference-3x"]["job_dir"])
    health = json.loads((job_dir / "summary.json").read_text())["health"]
    assert [(e["role"], e["action"]) for e in health["events"]] == [
        ("reference", "in_place"), ("reference", "in_place"), ("reference", "global"), ("engine_1", "in_place")]
    assert "failure 3 of this role in a row" in health["events"][2]["detail"]
    last = json.loads((job_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert (last["health/in_place_restarts"], last["health/global_restarts"]) == (3, 1)
    assert "health: reference died: global restart from the newest checkpoint" in (job_dir / "fault.log").read_text()


def group_tests(group: str) -> tuple[Any, ...]:
    """The module fixture and the tests of one group's module, in this order: `suite`,
    `test_fault_is_recovered_with_every_sample_trained_once`,
    `test_group_prints_the_table_and_the_last_line_and_exits_0`,
    `test_group_leaves_no_process_and_no_mount_behind` (a module assigns them to those names)."""

    @pytest.fixture(scope="module")
    def suite(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> SuiteResult:
        return run_group(tmp_path_factory.mktemp(f"faults-{group}"), tiny_model_dir, group)

    @pytest.mark.parametrize("fault", GROUPS[group])
    def recovered(suite: SuiteResult, fault: str) -> None:
        check_fault_recovered_with_every_sample_trained_once(suite, fault)

    def table(suite: SuiteResult) -> None:
        check_table_last_line_and_exit_0(suite)

    def nothing_left(suite: SuiteResult) -> None:
        check_no_process_and_no_mount_left(suite)

    return suite, recovered, table, nothing_left
