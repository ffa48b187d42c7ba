"""`relax-hpc faults` group "in_place" (tests/launch/fault_suite.py). A killed Reference, then a stopped (hung) one, in one run: each restarted in place.
"""

from __future__ import annotations

import pytest
from fault_suite import group_tests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test pays for the group's run

(suite, test_fault_is_recovered_with_every_sample_trained_once,
 test_group_prints_the_table_and_the_last_line_and_exits_0,
 test_group_leaves_no_process_and_no_mount_behind) = group_tests("in_place")
