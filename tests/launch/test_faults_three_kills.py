"""`relax-hpc faults` group "three_kills" (tests/launch/fault_suite.py). The Reference killed three times in a row (twice in place, then a global restart), then a rollout engine, in one run.
"""

from __future__ import annotations

import pytest
from fault_suite import SuiteResult, check_a_role_killed_three_times_in_a_row_restarts_the_whole_run, group_tests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test pays for the group's run

(suite, test_fault_is_recovered_with_every_sample_trained_once,
 test_group_prints_the_table_and_the_last_line_and_exits_0,
 test_group_leaves_no_process_and_no_mount_behind) = group_tests("three_kills")


def test_a_role_killed_three_times_in_a_row_restarts_the_whole_run(suite: SuiteResult) -> None:
    check_a_role_killed_three_times_in_a_row_restarts_the_whole_run(suite)
