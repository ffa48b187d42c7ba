"""`relax-hpc faults` group "global" (tests/launch/fault_suite.py). The faults that cost a global restart: a killed ActorFwd and a killed trainer rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fault_suite import (
    GROUPS,
    SuiteResult,
    check_fault_recovered_with_every_sample_trained_once,
    check_no_process_and_no_mount_left,
    check_table_last_line_and_exit_0,
    run_group,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test pays for the group's runs


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> SuiteResult:
    return run_group(tmp_path_factory.mktemp("faults-global"), tiny_model_dir, "global")


@pytest.mark.parametrize("fault", GROUPS["global"])
def test_fault_is_recovered_with_every_sample_trained_once(suite: SuiteResult, fault: str) -> None:
    check_fault_recovered_with_every_sample_trained_once(suite, fault)


def test_group_prints_the_table_and_the_last_line_and_exits_0(suite: SuiteResult) -> None:
    check_table_last_line_and_exit_0(suite)


def test_group_leaves_no_process_and_no_mount_behind(suite: SuiteResult) -> None:
    check_no_process_and_no_mount_left(suite)
