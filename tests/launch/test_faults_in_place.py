"""`relax-hpc faults` group "in_place" (tests/launch/fault_suite.py). The faults answered by a restart in place: a killed engine, a killed or hung Reference, and a
Reference killed three times in a row (the third a global restart).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_suite import (
    GROUPS,
    SuiteResult,
    check_fault_recovered_with_every_sample_trained_once,
    check_no_process_and_no_mount_left,
    check_a_role_killed_three_times_in_a_row_restarts_the_whole_run,
    check_table_last_line_and_exit_0,
    run_group,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test pays for the group's runs


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> SuiteResult:
    return run_group(tmp_path_factory.mktemp("faults-in_place"), tiny_model_dir, "in_place")


@pytest.mark.parametrize("fault", GROUPS["in_place"])
def test_fault_is_recovered_with_every_sample_trained_once(suite: SuiteResult, fault: str) -> None:
    check_fault_recovered_with_every_sample_trained_once(suite, fault)


def test_group_prints_the_table_and_the_last_line_and_exits_0(suite: SuiteResult) -> None:
    check_table_last_line_and_exit_0(suite)


def test_group_leaves_no_process_and_no_mount_behind(suite: SuiteResult) -> None:
    check_no_process_and_no_mount_left(suite)


def test_a_role_killed_three_times_in_a_row_restarts_the_whole_run(suite: SuiteResult) -> None:
    check_a_role_killed_three_times_in_a_row_restarts_the_whole_run(suite)
