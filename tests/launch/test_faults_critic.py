"""`relax-hpc faults` group "critic" (tests/launch/fault_suite.py): a killed critic (PPO with
advantage = "gae") costs a global restart, as a killed trainer rank does, and the run resumes
from its newest checkpoint, the critic's included, with every sample trained once.
"""

from __future__ import annotations

import pytest
from fault_suite import group_tests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test pays for the group's run

(suite, test_fault_is_recovered_with_every_sample_trained_once,
 test_group_prints_the_table_and_the_last_line_and_exits_0,
 test_group_leaves_no_process_and_no_mount_behind) = group_tests("critic")
